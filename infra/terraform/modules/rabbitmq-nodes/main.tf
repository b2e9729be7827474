# A RabbitMQ cluster on EC2: an autoscaling group of Debian 13 (trixie) nodes
# that install Debian's rabbitmq-server (4.0.5, the release the local
# federation runs too) through cloud-init, take fedgate's rendered config, and
# find each other through AWS peer discovery (by autoscaling group).
# The gateway-region and backend modules both stamp their nodes out with it.

data "aws_region" "current" {}

# Debian names its images after the architecture (debian-13-amd64-*,
# debian-13-arm64-*): the instance type decides which one boots.
data "aws_ec2_instance_type" "this" {
  count = var.ami_id == null ? 1 : 0

  instance_type = var.instance_type
}

locals {
  ami_arch = var.ami_id != null ? null : (
    contains(data.aws_ec2_instance_type.this[0].supported_architectures, "x86_64") ? "amd64" : "arm64"
  )
}

data "aws_ami" "debian" {
  count = var.ami_id == null ? 1 : 0

  most_recent = true
  owners      = var.ami_owners

  filter {
    name   = "name"
    values = [coalesce(var.ami_name_filter, "debian-13-${local.ami_arch}-*")]
  }

  filter {
    name   = "architecture"
    values = [local.ami_arch == "amd64" ? "x86_64" : "arm64"]
  }
}

locals {
  has_definitions = var.definitions != ""

  # Debian 13's rabbitmq-server is 4.0.x (4.0.5-6+deb13u2 when this was
  # written); a node with any other release stays stopped and says why.
  rabbitmq_release = "4.0"
  env_file         = "/etc/rabbitmq/rabbitmq-env.conf"
  start_if_release = join(" ", [
    # a node without its IP name would boot a cluster of its own: better not at all
    "grep -q '^NODENAME=rabbit@' ${local.env_file} ||",
    "{ echo 'fedgate: no node name from the metadata service in ${local.env_file}; not started' >&2; exit 1; };",
    "v=$(dpkg-query -W -f='$${Version}' rabbitmq-server);",
    "case \"$v\" in",
    "${local.rabbitmq_release}.*) systemctl start rabbitmq-server ;;",
    "*) echo \"fedgate: rabbitmq-server $v is not ${local.rabbitmq_release} (boot a Debian 13 AMI); not started\" >&2; exit 1 ;;",
    "esac",
  ])

  rabbitmq_conf = join("\n", [
    var.rabbitmq_conf,
    "# --- cloud: rendered by the rabbitmq-nodes Terraform module ---",
    "cluster_formation.peer_discovery_backend = aws",
    "cluster_formation.aws.region = ${data.aws_region.current.name}",
    "cluster_formation.aws.use_autoscaling_group = true",
    "cluster_formation.aws.use_private_ip = true",
    # The first nodes wait for each other instead of each forming a cluster of one.
    "cluster_formation.target_cluster_size_hint = ${var.node_count}",
    # The autoscaling group replaces a failed node with a new instance, a new IP and so
    # a new node name: the old name stays a member that never comes back, counts
    # against every majority and holds quorum queue replicas. Peer discovery lists the
    # group's instances only, so a node it no longer lists is one the group terminated
    # (a stopped or rebooting node keeps its place in the group and is not removed).
    "cluster_formation.node_cleanup.interval = ${var.node_cleanup_interval}",
    "cluster_formation.node_cleanup.only_log_warning = false",
    # RabbitMQ 4.0 grows quorum queues back onto the replacement node (and drops the
    # replicas of removed nodes), so a queue returns to one replica per node without an
    # operator running rabbitmq-queues grow/shrink.
    "quorum_queue.continuous_membership_reconciliation.enabled = true",
    "quorum_queue.continuous_membership_reconciliation.target_group_size = ${var.node_count}",
    "quorum_queue.continuous_membership_reconciliation.auto_remove = true",
    local.has_definitions ? "load_definitions = /etc/rabbitmq/definitions.json" : "",
    "",
  ])
  enabled_plugins = replace(trimspace(var.enabled_plugins), "].", ",rabbitmq_peer_discovery_aws].")

  # fedgate's own Erlang plugins: sources on the node, compiled there by the
  # Erlang that runs it (a plugin must be), into a folder that comes first in
  # the node's plugins path, before the package's own.
  plugins_root    = "/usr/local/lib/fedgate/rabbitmq-plugins"
  package_plugins = "$(ls -d /usr/lib/rabbitmq/lib/rabbitmq_server-*/plugins | tail -n 1)"
  plugin_files = flatten([
    for name, p in var.erlang_plugins : concat(
      [{ path = "${local.plugins_root}/${name}-${p.vsn}/ebin/${name}.app", permissions = "0644", content = p.app }],
      [for file, content in p.sources : { path = "/usr/local/src/fedgate/${name}/${file}", permissions = "0644", content = content }],
    )
  ])
  compile_plugins = [
    for name, p in var.erlang_plugins : [
      "sh", "-c",
      "ERL_LIBS=${local.package_plugins} erlc -o ${local.plugins_root}/${name}-${p.vsn}/ebin /usr/local/src/fedgate/${name}/*.erl",
    ]
  ]
  # rabbitmq-env.conf is sourced by RabbitMQ's scripts (sh): the package's folder is found at
  # boot. NODENAME and USE_LONGNAME are added at boot (nodename_script): the address is the
  # instance's, unknown here.
  rabbitmq_env = join("", concat(
    ["# written by the rabbitmq-nodes Terraform module; ${local.nodename_script} adds the node name\n"],
    var.erl_args == "" ? [] : ["SERVER_ADDITIONAL_ERL_ARGS=\"${var.erl_args}\"\n"],
    length(var.erlang_plugins) == 0 ? [] : ["PLUGINS_DIR=\"${local.plugins_root}:${local.package_plugins}\"\n"],
    # a socket is an Erlang port, and RabbitMQ's scripts cap ports at 65,536 unless told
    # (sbin/rabbitmq-env): a descriptor limit above that would not admit more connections
    var.max_fds == null ? [] : (var.max_fds > 65536 ? ["export ERL_MAX_PORTS=${var.max_fds}\n"] : []),
  ))
  nodename_script = "/usr/local/sbin/fedgate-rabbitmq-nodename"

  user_data = join("\n", ["#cloud-config", yamlencode({
    package_update = true
    # ca-certificates: RabbitMQ 4.0's Erlang (27) loads the system's CA store
    # for any HTTP request, also the plain-HTTP metadata query of AWS peer
    # discovery; without it the node fails to boot (no_cacerts_found), and
    # rabbitmq-server does not depend on it.
    # curl: the node name's address comes from the metadata service (nodename_script).
    packages = ["ca-certificates", "curl", "rabbitmq-server"]
    write_files = concat(
      [
        { path = "/etc/rabbitmq/rabbitmq.conf", permissions = "0640", content = local.rabbitmq_conf },
        { path = "/etc/rabbitmq/enabled_plugins", permissions = "0644", content = "${local.enabled_plugins}\n" },
        { path = "/etc/fedgate/erlang.cookie", permissions = "0400", content = var.erlang_cookie },
        { path = local.env_file, permissions = "0644", content = local.rabbitmq_env },
        { path = local.nodename_script, permissions = "0755", content = file("${path.module}/files/rabbitmq-nodename.sh") },
        # Debian's package would start the broker on install, under the host name and
        # with its own cookie, and try to join the cluster as a stranger. Services stay
        # down until runcmd (which removes this file again, for later upgrades).
        { path = "/usr/sbin/policy-rc.d", permissions = "0755", content = "#!/bin/sh\n# fedgate: no service starts while cloud-init installs packages\nexit 101\n" },
      ],
      local.plugin_files,
      var.max_fds == null ? [] : [
        {
          path        = "/etc/systemd/system/rabbitmq-server.service.d/fedgate.conf"
          permissions = "0644"
          content     = "[Service]\nLimitNOFILE=${var.max_fds}\n"
        },
      ],
      local.has_definitions ? [
        { path = "/etc/rabbitmq/definitions.json", permissions = "0640", content = var.definitions },
      ] : [],
      # chowned to rabbitmq with the rest of /etc/rabbitmq below; the key readable by it only
      var.tls_files == null ? [] : [
        { path = "/etc/rabbitmq/tls/ca.pem", permissions = "0644", content = var.tls_files.ca_pem },
        { path = "/etc/rabbitmq/tls/cert.pem", permissions = "0644", content = var.tls_files.cert_pem },
        { path = "/etc/rabbitmq/tls/key.pem", permissions = "0400", content = var.tls_files.key_pem },
      ],
    )
    # The broker's first start: with the cluster's cookie, fedgate's config and
    # the node's IP name -- only if the package is the release fedgate runs
    # everywhere (another AMI could bring another one). Whatever a start before
    # this one left behind (an image that started it anyway) is stopped and its
    # data removed, so that the node joins the cluster as itself.
    runcmd = concat([
      ["rm", "-f", "/usr/sbin/policy-rc.d"],
      ["systemctl", "stop", "rabbitmq-server"],
      ], local.compile_plugins, [
      [local.nodename_script, local.env_file],
      ["install", "-o", "rabbitmq", "-g", "rabbitmq", "-m", "0400", "/etc/fedgate/erlang.cookie", "/var/lib/rabbitmq/.erlang.cookie"],
      ["chown", "-R", "rabbitmq:rabbitmq", "/etc/rabbitmq"],
      ["rm", "-rf", "/var/lib/rabbitmq/mnesia"],
      ["systemctl", "daemon-reload"],
      ["sh", "-c", local.start_if_release],
    ])
  })])
}

# Peer discovery: a node finds the others through its autoscaling group.
resource "aws_iam_role" "this" {
  name = var.name
  tags = var.tags
  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "ec2.amazonaws.com" }
      Action    = "sts:AssumeRole"
    }]
  })
}

resource "aws_iam_role_policy" "peer_discovery" {
  name = "rabbitmq-peer-discovery"
  role = aws_iam_role.this.id
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect   = "Allow"
      Action   = ["autoscaling:DescribeAutoScalingInstances", "ec2:DescribeInstances"]
      Resource = "*"
    }]
  })
}

resource "aws_iam_instance_profile" "this" {
  name = var.name
  role = aws_iam_role.this.name
  tags = var.tags
}

resource "aws_launch_template" "this" {
  name                   = var.name
  image_id               = coalesce(var.ami_id, try(data.aws_ami.debian[0].id, null))
  instance_type          = var.instance_type
  user_data              = base64encode(local.user_data)
  vpc_security_group_ids = var.security_group_ids
  # No tags on the template itself: the instances get theirs from
  # tag_specifications and the autoscaling group (moto echoes template tags
  # back as an extra tag_specifications block, which would re-plan forever).

  iam_instance_profile {
    arn = aws_iam_instance_profile.this.arn
  }

  # IMDSv2 only: a node reads its private address (its node name) with a session
  # token; one hop, so a container on the node cannot reach the node's role.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = var.name })
  }
}

resource "aws_autoscaling_group" "this" {
  name                = var.name
  min_size            = var.node_count
  max_size            = var.node_count
  desired_capacity    = var.node_count
  vpc_zone_identifier = var.subnet_ids
  target_group_arns   = var.target_group_arns
  health_check_type   = "ELB"

  launch_template {
    id      = aws_launch_template.this.id
    version = aws_launch_template.this.latest_version
  }

  dynamic "tag" {
    for_each = merge(var.tags, { Name = var.name })
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }
}
