variable "name" {
  description = "Name of the IAM role, instance profile, launch template and autoscaling group, and the Name tag of the nodes."
  type        = string
}

variable "tags" {
  description = "Tags on every resource and every node."
  type        = map(string)
  default     = {}
}

variable "rabbitmq_conf" {
  description = "The node's rabbitmq.conf as fedgate's template renders it; the module appends AWS peer discovery (and load_definitions)."
  type        = string
  sensitive   = true
}

variable "enabled_plugins" {
  description = "The node's enabled_plugins file (an Erlang list); the module adds rabbitmq_peer_discovery_aws."
  type        = string
}

variable "erlang_cookie" {
  description = "Shared Erlang cookie of the cluster."
  type        = string
  sensitive   = true
}

variable "definitions" {
  description = "RabbitMQ definitions (JSON) every node loads at boot; empty: none."
  type        = string
  default     = ""
  sensitive   = true
}

variable "erl_args" {
  description = "Extra Erlang emulator flags of the nodes (SERVER_ADDITIONAL_ERL_ARGS in /etc/rabbitmq/rabbitmq-env.conf); empty: none."
  type        = string
  default     = ""
}

variable "max_fds" {
  description = "File descriptor limit of the RabbitMQ service (a systemd drop-in; above 65536 also Erlang's port limit, ERL_MAX_PORTS); null keeps the package's."
  type        = number
  default     = null
}

variable "ami_id" {
  description = "AMI of the nodes; it must be Debian 13 (trixie), whose rabbitmq-server 4.0.5 every fedgate node runs (a node with another release does not start its broker). Null: the newest AMI of ami_owners named ami_name_filter, for the instance type's architecture."
  type        = string
  default     = null
}

variable "ami_owners" {
  description = "Accounts the AMI lookup takes images from (when ami_id is null): Debian's official account; other AWS partitions have their own."
  type        = list(string)
  default     = ["136693071363"]
}

variable "ami_name_filter" {
  description = "Name filter of the AMI lookup (when ami_id is null). Null: debian-13-amd64-* or debian-13-arm64-*, as the instance type's architecture asks (Debian 13's official images)."
  type        = string
  default     = null
}

variable "instance_type" {
  description = "EC2 instance type of a node (cost knob)."
  type        = string
}

variable "node_count" {
  description = "Nodes in the autoscaling group; they form one RabbitMQ cluster (cost knob). At least 3: quorum queues and the cluster's own state need a majority of the nodes, and 3 keep one through the loss of a node. 1 with allow_single_node; never 2 (losing either node loses the majority)."
  type        = number
  default     = 3

  validation {
    condition     = floor(var.node_count) == var.node_count && (var.node_count >= 3 || (var.allow_single_node && var.node_count == 1))
    error_message = "node_count: at least 3, so that a majority survives the loss of a node; 1 only with allow_single_node = true (development, no redundancy)."
  }
}

variable "allow_single_node" {
  description = "Allow node_count = 1: a cluster of one node for development, with no redundancy (its loss stops the broker)."
  type        = bool
  default     = false
}

variable "node_cleanup_interval" {
  description = "Seconds between a node's checks for cluster members the autoscaling group no longer lists (replaced instances); those are removed from the cluster."
  type        = number
  default     = 60

  validation {
    condition     = var.node_cleanup_interval >= 10
    error_message = "node_cleanup_interval: at least 10 seconds."
  }
}

variable "subnet_ids" {
  description = "Subnets the nodes are spread over (one per availability zone)."
  type        = list(string)
}

variable "security_group_ids" {
  description = "Security groups of the nodes."
  type        = list(string)
}

variable "target_group_arns" {
  description = "Load balancer target groups the nodes register with (their health decides the nodes' health)."
  type        = list(string)
  default     = []
}

variable "tls_files" {
  description = "PEM files for the nodes' TLS listeners, written to /etc/rabbitmq/tls/{ca,cert,key}.pem (the paths the TLS listener lines in rabbitmq_conf name). Null: no TLS files."
  type = object({
    ca_pem   = string
    cert_pem = string
    key_pem  = string
  })
  default   = null
  sensitive = true
}

variable "erlang_plugins" {
  description = "fedgate's own Erlang plugins, compiled on each node by its erlc into /usr/local/lib/fedgate/rabbitmq-plugins (first in the node's PLUGINS_DIR): app name => { vsn, app (the .app file), sources (file name => .erl text) }. Enable them in enabled_plugins."
  type = map(object({
    vsn     = string
    app     = string
    sources = map(string)
  }))
  default = {}
}
