variable "region" {
  description = "fedgate region name of this gateway cluster; also its RabbitMQ cluster name and the Route53 set identifier. For cloud regions it is the AWS region name (e.g. eu-west-1)."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}[a-z0-9]$", var.region))
    error_message = "region: 3-32 lowercase letters, digits and hyphens, starting with a letter (backend/contract.py REGION_RE)."
  }
}

variable "name_prefix" {
  description = "Prefix of every resource name."
  type        = string
  default     = "fedgate"
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}

# --- network -------------------------------------------------------------------

variable "vpc_cidr" {
  description = "CIDR block of the region's VPC."
  type        = string
  default     = "10.40.0.0/16"
}

variable "az_count" {
  description = "Availability zones to spread subnets, gateway nodes and the load balancer over."
  type        = number
  default     = 2

  validation {
    condition     = var.az_count >= 1 && var.az_count <= 6
    error_message = "az_count: between 1 and 6."
  }
}

variable "device_cidr_blocks" {
  description = "Where devices connect from: MQTT (1883) and MQTT over TLS (8883) are open to these."
  type        = list(string)
  default     = ["0.0.0.0/0"]
}

variable "backend_cidr_blocks" {
  description = "Addresses of the backend RabbitMQ cluster: AMQP/AMQPS (5672/5671) are accepted only from and sent only to these."
  type        = list(string)
}

variable "admin_cidr_blocks" {
  description = "Operators (and the routers, which reconcile presence through the management API): the only sources allowed on the management port (15671, HTTPS, with node_tls; 15672 without)."
  type        = list(string)
}

# --- gateway nodes ------------------------------------------------------------

variable "ami_id" {
  description = "AMI of the gateway nodes; it must be Debian 13 (trixie), whose rabbitmq-server 4.0.5 every fedgate node runs. Null: the newest official Debian 13 AMI for the instance type's architecture (ami_owners, ami_name_filter)."
  type        = string
  default     = null
}

variable "ami_owners" {
  description = "Accounts the AMI lookup takes images from (when ami_id is null): Debian's official account; other AWS partitions have their own."
  type        = list(string)
  default     = ["136693071363"]
}

variable "ami_name_filter" {
  description = "Name filter of the AMI lookup (when ami_id is null). Null: debian-13-amd64-* or debian-13-arm64-*, as the instance type's architecture asks."
  type        = string
  default     = null
}

variable "instance_type" {
  description = "EC2 instance type of a gateway node (cost knob: ~92 KB of RAM per device with a QoS 1 command subscription on RabbitMQ 4.0.5; a Graviton type boots the arm64 image)."
  type        = string
  default     = "t3.small"
}

variable "node_count" {
  description = "Gateway nodes in the autoscaling group; they form one RabbitMQ cluster (cost knob). At least 3, so that a majority (quorum queues, the cluster's own state) survives the loss of a node; 1 with allow_single_node; never 2."
  type        = number
  default     = 3

  validation {
    condition     = floor(var.node_count) == var.node_count && (var.node_count >= 3 || (var.allow_single_node && var.node_count == 1))
    error_message = "node_count: at least 3, so that a majority survives the loss of a node; 1 only with allow_single_node = true (development, no redundancy)."
  }
}

variable "allow_single_node" {
  description = "Allow node_count = 1: a gateway of one node for development, with no redundancy (its loss takes the region's devices offline until the autoscaling group replaces it)."
  type        = bool
  default     = false
}

variable "memory_mb" {
  description = "vm_memory_high_watermark.absolute of each gateway node (MB); leave room for the OS."
  type        = number
  default     = 1024
}

variable "max_fds" {
  description = "File descriptor limit of the RabbitMQ service (one per device connection; a node stops accepting at 90%)."
  type        = number
  default     = 65536
}

variable "mqtt_tcp_buffer" {
  description = "MQTT socket sndbuf/recbuf in bytes (the kernel default costs ~4 MB per connection)."
  type        = number
  default     = 32768
}

variable "admin_password" {
  description = "Password of fedgate-admin on the gateway nodes."
  type        = string
  sensitive   = true
}

variable "erlang_cookie" {
  description = "Shared Erlang cookie of the region's RabbitMQ cluster."
  type        = string
  sensitive   = true
}

variable "rabbitmq_definitions" {
  description = "RabbitMQ definitions (JSON) loaded at boot: the gateway's users, its downlink exchange and the federation upstream to the backend (rendered by fedgate from gateways/wiring.py). Empty: none."
  type        = string
  default     = ""
  sensitive   = true
}

# --- what the node runs: fedgate's files, passed in by the caller -----------------
# The module reads nothing outside its folder (it works from a registry or a git
# subfolder): the gateway's templates and plugin come in as text.

variable "rabbitmq_conf_template" {
  description = "The gateway's rabbitmq.conf template (fedgate's gateways/templates/rabbitmq.conf, the one the local driver renders); the module fills in region, cluster_name, host, mqtt_host, amqp_port, management_port, prometheus_port, mqtt_port, mqtt_tcp_buffer, memory_mb, admin_user and admin_password."
  type        = string
}

variable "tls_conf_template" {
  description = "The TLS listener lines' template (gateways/templates/tls.conf); the module fills in host, amqps_port, cacertfile, certfile, keyfile and mqtts_listener. Required with node_tls."
  type        = string
  default     = null

  validation {
    condition     = var.node_tls == null || var.tls_conf_template != null
    error_message = "tls_conf_template: required with node_tls (gateways/templates/tls.conf)."
  }
}

variable "enabled_plugins" {
  description = "The gateway's enabled_plugins file (gateways/templates/enabled_plugins, an Erlang list)."
  type        = string
}

variable "erl_args" {
  description = "Extra Erlang emulator flags of the gateway nodes (gateways/templates/erl_args, the local gateways' flags); empty: none."
  type        = string
  default     = ""
}

variable "erlang_plugins" {
  description = "fedgate's own Erlang plugins the gateway enables, compiled on each node: app name => { vsn, app (the .app file), sources (file name => .erl text) }. The gateway's rabbitmq.conf authenticates with fedgate_mqtt_auth (gateways/mqtt_auth_plugin), so it must be here."
  type = map(object({
    vsn     = string
    app     = string
    sources = map(string)
  }))
}

# --- load balancer and DNS ----------------------------------------------------

variable "node_tls" {
  description = <<-EOT
    TLS on the gateway nodes (`fedgate` issues it from its CA): the nodes listen for
    AMQPS on 5671, which the backend's federation links use and check against
    the CA and server_name, and for MQTT over TLS on 8883 (passed through the
    load balancer unless certificate_arn terminates it there). The key is
    node_tls_key_pem. Null: plain AMQP.
  EOT
  type = object({
    ca_pem      = string
    cert_pem    = string
    server_name = string
  })
  default = null
}

variable "node_tls_key_pem" {
  description = "Private key of node_tls's certificate (PEM). Required with node_tls."
  type        = string
  default     = null
  sensitive   = true
}

variable "certificate_arn" {
  description = "ACM certificate for MQTT over TLS: the load balancer terminates TLS on 8883 and forwards to 1883. Null: 8883 passes through to the nodes when node_tls is set, else no 8883 listener."
  type        = string
  default     = null
}

variable "create_dns_record" {
  description = "Create the Route53 latency record and its health check for the region's MQTT hostname."
  type        = bool
  default     = true
}

variable "zone_id" {
  description = "Route53 hosted zone holding the MQTT hostname (needed when create_dns_record is true)."
  type        = string
  default     = null
}

variable "mqtt_hostname" {
  description = "The fleet's MQTT hostname (e.g. mqtt.example.com); every region adds a latency record under this one name."
  type        = string
  default     = null
}

variable "dns_ttl" {
  description = "TTL of the latency record in seconds: how long a device may keep resolving to a region that failed its health check."
  type        = number
  default     = 60
}

variable "health_check_interval" {
  description = "Seconds between the load balancer's checks of each gateway node: an HTTP GET of RabbitMQ's /metrics on 15692, which a hung node does not answer (5 to 300)."
  type        = number
  default     = 10

  validation {
    condition     = var.health_check_interval >= 5 && var.health_check_interval <= 300
    error_message = "health_check_interval: 5 to 300 seconds."
  }
}

variable "health_check_timeout" {
  description = "Seconds a node has to answer one check (2 to 120, less than health_check_interval)."
  type        = number
  default     = 5

  validation {
    condition     = var.health_check_timeout >= 2 && var.health_check_timeout < var.health_check_interval
    error_message = "health_check_timeout: at least 2 seconds and less than health_check_interval."
  }
}

variable "health_check_failure_threshold" {
  description = "Checks in a row a node fails before the load balancer stops sending it devices (2 to 10)."
  type        = number
  default     = 2

  validation {
    condition     = var.health_check_failure_threshold >= 2 && var.health_check_failure_threshold <= 10
    error_message = "health_check_failure_threshold: 2 to 10."
  }
}

variable "health_check_healthy_threshold" {
  description = "Checks in a row a node passes before the load balancer sends it devices again (2 to 10)."
  type        = number
  default     = 2

  validation {
    condition     = var.health_check_healthy_threshold >= 2 && var.health_check_healthy_threshold <= 10
    error_message = "health_check_healthy_threshold: 2 to 10."
  }
}

variable "health_check_alarm_minutes" {
  description = "Minutes in a row in which the load balancer saw no healthy gateway node before Route53 stops answering the region (its CloudWatch alarm over HealthyHostCount)."
  type        = number
  default     = 1

  validation {
    condition     = var.health_check_alarm_minutes >= 1
    error_message = "health_check_alarm_minutes: at least 1."
  }
}
