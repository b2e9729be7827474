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

variable "vpc_cidr" {
  description = "CIDR block of the backend's VPC."
  type        = string
  default     = "10.30.0.0/16"
}

variable "az_count" {
  description = "Availability zones for the backend nodes, Kafka brokers and the load balancer (Kafka needs at least 2)."
  type        = number
  default     = 3

  validation {
    condition     = var.az_count >= 2 && var.az_count <= 6
    error_message = "az_count: between 2 and 6."
  }
}

variable "gateway_cidr_blocks" {
  description = "Where the gateways' downlink federation links come from (their public egress). AMQPS/AMQP is open only to these."
  type        = list(string)
}

variable "admin_cidr_blocks" {
  description = "Operators and the fedgate CLI (it registers regions through the management API): the only sources allowed on the management port (15671, HTTPS, with node_tls; 15672 without)."
  type        = list(string)
}

variable "ami_id" {
  description = "AMI of the backend nodes; it must be Debian 13 (trixie), whose rabbitmq-server 4.0.5 every fedgate node runs. Null: the newest official Debian 13 AMI for the instance type's architecture (ami_owners, ami_name_filter)."
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
  description = "EC2 instance type of a backend RabbitMQ node (cost knob)."
  type        = string
  default     = "m6i.large"
}

variable "node_count" {
  description = "Backend RabbitMQ nodes (cost knob). At least 3, so that the quorum queues and the cluster's own state keep a majority through the loss of a node; 1 with allow_single_node; never 2."
  type        = number
  default     = 3

  validation {
    condition     = floor(var.node_count) == var.node_count && (var.node_count >= 3 || (var.allow_single_node && var.node_count == 1))
    error_message = "node_count: at least 3, so that a majority survives the loss of a node; 1 only with allow_single_node = true (development, no redundancy)."
  }
}

variable "allow_single_node" {
  description = "Allow node_count = 1: a backend of one node for development, with no redundancy."
  type        = bool
  default     = false
}

variable "memory_mb" {
  description = "vm_memory_high_watermark.absolute of each backend node (MB)."
  type        = number
  default     = 4096
}

variable "admin_password" {
  description = "Password of fedgate-admin on the backend nodes (the CLI registers regions with it)."
  type        = string
  sensitive   = true
}

variable "erlang_cookie" {
  description = "Shared Erlang cookie of the backend RabbitMQ cluster."
  type        = string
  sensitive   = true
}

# The module reads nothing outside its folder (it works from a registry or a git
# subfolder): fedgate's node templates come in as text.

variable "rabbitmq_conf_template" {
  description = "The backend's rabbitmq.conf template (fedgate's backend/templates/rabbitmq.conf, the one the local backend renders); the module fills in cluster_name, host, amqp_port, management_port, prometheus_port, memory_mb, admin_user and admin_password."
  type        = string
}

variable "enabled_plugins" {
  description = "The backend's enabled_plugins file (backend/templates/enabled_plugins, an Erlang list)."
  type        = string
}

variable "tls_conf_template" {
  description = "The TLS listener lines' template every fedgate node shares (gateways/templates/tls.conf); the module fills in host, amqps_port, cacertfile, certfile, keyfile and mqtts_listener (empty here). Required with node_tls."
  type        = string
  default     = null

  validation {
    condition     = var.node_tls == null || var.tls_conf_template != null
    error_message = "tls_conf_template: required with node_tls (gateways/templates/tls.conf)."
  }
}

variable "create_nat_gateway" {
  description = "A NAT gateway with a fixed address for the backend's egress: the gateways' security groups admit the backend's federation links by that address (cost knob: ~32 USD/month plus traffic)."
  type        = bool
  default     = true
}

variable "create_kafka" {
  description = "Create an Amazon MSK cluster for the router's Kafka bridge. False: bring your own Kafka."
  type        = bool
  default     = true
}

variable "kafka_version" {
  description = "Apache Kafka version of the MSK cluster."
  type        = string
  default     = "3.6.0"
}

variable "kafka_instance_type" {
  description = "MSK broker instance type (cost knob)."
  type        = string
  default     = "kafka.t3.small"
}

variable "kafka_brokers_per_az" {
  description = "MSK brokers in each availability zone (cost knob); az_count x kafka_brokers_per_az must be at least 3 (every partition has 3 replicas)."
  type        = number
  default     = 1
}

variable "kafka_volume_gb" {
  description = "EBS volume per Kafka broker (GB)."
  type        = number
  default     = 100
}

variable "analytics_bucket_name" {
  description = "S3 bucket the Spark jobs write the analysts' tables to."
  type        = string
}

variable "analytics_bucket_force_destroy" {
  description = "Allow destroying the analytics bucket while it holds tables."
  type        = bool
  default     = false
}

variable "analytics_noncurrent_days" {
  description = "Days old versions of table files are kept in the analytics bucket (cost knob)."
  type        = number
  default     = 30
}

variable "node_tls" {
  description = <<-EOT
    TLS on the backend nodes (`fedgate cloud-tls backend` issues it from fedgate's
    CA): AMQPS on 5671 for the gateways' downlink links, which check the
    certificate against the CA and server_name; the CA also checks the
    gateways when the backend's links connect to them. The key is
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

variable "fedgate_release" {
  description = "Where the fedgate release (`make release`) is in S3: { bucket, key of the wheel, jars_key of the Spark jars archive }. Set: the module deploys the routers (fedgate-service module) from it, and the Spark job when jars_key is set. Null: run them yourself. A new key rolls a new release out to replaced instances."
  type = object({
    bucket   = string
    key      = string
    jars_key = optional(string)
  })
  default = null
}

variable "router_count" {
  description = "Router instances (at least 2: they share the uplink shards and one leads the downlink; the others take over when it dies)."
  type        = number
  default     = 2
}

variable "router_instance_type" {
  description = "EC2 instance type of a router (cost knob)."
  type        = string
  default     = "t3.medium"
}

variable "router_password" {
  description = "Password of the routers' user on the backend (fedgate-router), from `fedgate backend-tls` (backend-secrets.auto.tfvars.json); `make gateway` creates the user with it. Required with fedgate_release."
  type        = string
  default     = null
  sensitive   = true
}

variable "kafka_sasl_password" {
  description = "Password of the Kafka SCRAM user the routers and the Spark job log in as (MSK's SASL/SCRAM listener), from `fedgate backend-tls` (backend-secrets.auto.tfvars.json). Required with create_kafka."
  type        = string
  default     = null
  sensitive   = true
}

variable "router_config_extra" {
  description = "More router.toml lines (router/settings.py), appended to the ones the module renders: its mapping rules, partitions, intervals."
  type        = string
  default     = ""
}

variable "kafka_bootstrap" {
  description = "Kafka bootstrap servers (SASL/SCRAM over TLS) of your own Kafka when create_kafka is false; the routers log in as fedgate with kafka_sasl_password."
  type        = string
  default     = null
}

variable "spark_topics" {
  description = "Kafka topics the Spark job reads: the ones the routers' mapping rules write (router.topics.kafka_topics; these are the default rules'). Change both together."
  type        = list(string)
  default     = ["fedgate.deadletter", "fedgate.unmatched", "telemetry.acks", "telemetry.events", "telemetry.replies", "telemetry.state", "telemetry.telemetry"]
}

variable "spark_instance_type" {
  description = "EC2 instance type of the Spark job (it wants memory; cost knob)."
  type        = string
  default     = "m6i.large"
}

variable "spark_config_extra" {
  description = "More spark.toml lines (spark/settings.py), appended to the ones the module renders: triggers, memory, compaction."
  type        = string
  default     = ""
}

variable "catalog_password" {
  description = "Password of the tables' catalog database (RDS PostgreSQL, user fedgate), from `fedgate backend-tls` (backend-secrets.auto.tfvars.json). Required to deploy the Spark job."
  type        = string
  default     = null
  sensitive   = true
}

variable "catalog_instance_class" {
  description = "RDS instance class of the catalog database (it holds one row per table: small is plenty)."
  type        = string
  default     = "db.t4g.micro"
}

variable "catalog_engine_version" {
  description = "PostgreSQL major version of the catalog database."
  type        = string
  default     = "16"
}

variable "catalog_multi_az" {
  description = "A standby of the catalog database in another zone (the tables cannot commit while it is down)."
  type        = bool
  default     = true
}

variable "catalog_deletion_protection" {
  description = "Refuse to delete the catalog database (it names the tables), and keep a final snapshot when it goes."
  type        = bool
  default     = true
}
