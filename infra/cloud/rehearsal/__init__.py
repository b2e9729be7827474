"""The cloud rehearsal: what the Terraform modules would boot on EC2, booted on this machine.

`make cloud-rehearsal` (``fedgate cloud-rehearsal``) plans the backend example against moto
(AWS's APIs, nothing booted), takes the RabbitMQ nodes' cloud-init from the planned launch
template, and runs it on three "instances" of this machine: network namespaces of their own
(one address each, the same ports as on EC2: 5672, 15672, 25672, epmd's 4369) behind a
bridge, with a stand-in of EC2's instance metadata service (IMDSv2) that answers each one
its own address.  Each instance writes cloud-init's files to its own /etc/rabbitmq and
/var/lib/rabbitmq, names its node with the module's own script and starts Debian 13's
RabbitMQ 4.0 with them, unchanged but for one thing: AWS peer discovery (which asks EC2 for
the autoscaling group's instances) is replaced by the same three names listed
(classic_config), as EC2 would have answered.  The rehearsal then checks what an operator
would: one cluster of three nodes named rabbit@<private address>, a quorum queue with a
replica on each node, and that the queue keeps its messages and takes new ones with one
node killed.

Parts: moto.py (the stand-in AWS), render.py (cloud-init out of a planned example),
hosts.py (the instances' network), imds.py (the metadata service), instance.py (one
instance's boot), run.py (the whole rehearsal and its checks).
"""
