# The backend: one RabbitMQ cluster every region's gateways federate with,
# Kafka (Amazon MSK) behind the router's bridge, and the analytics bucket
# Spark writes its tables to.

data "aws_availability_zones" "available" {
  state = "available"
}

locals {
  name = "${var.name_prefix}-backend"
  azs  = slice(data.aws_availability_zones.available.names, 0, var.az_count)
  tags = merge({ "fedgate:role" = "backend" }, var.tags)

  # The TLS listener lines every fedgate node shares (local and cloud).
  node_tls = var.node_tls != null
  # Operators reach the management API through the load balancer: over HTTPS with node TLS.
  management_tls_port = 15671
  management_lb_port  = local.node_tls ? local.management_tls_port : 15672
  tls_dir             = "/etc/rabbitmq/tls"
  tls_conf = local.node_tls ? templatestring(var.tls_conf_template, {
    host                = "0.0.0.0"
    amqps_port          = 5671
    management_tls_port = local.management_tls_port
    cacertfile          = "${local.tls_dir}/ca.pem"
    certfile            = "${local.tls_dir}/cert.pem"
    keyfile             = "${local.tls_dir}/key.pem"
    mqtts_listener      = ""
  }) : ""
}

# --- network ----------------------------------------------------------------------

resource "aws_vpc" "this" {
  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true
  tags                 = merge(local.tags, { Name = local.name })
}

resource "aws_internet_gateway" "this" {
  vpc_id = aws_vpc.this.id
  tags   = merge(local.tags, { Name = local.name })
}

resource "aws_subnet" "public" {
  count = var.az_count

  vpc_id            = aws_vpc.this.id
  availability_zone = local.azs[count.index]
  cidr_block        = cidrsubnet(var.vpc_cidr, 8, count.index)
  tags              = merge(local.tags, { Name = "${local.name}-public-${local.azs[count.index]}" })
}

resource "aws_subnet" "private" {
  count = var.az_count

  vpc_id            = aws_vpc.this.id
  availability_zone = local.azs[count.index]
  cidr_block        = cidrsubnet(var.vpc_cidr, 8, 100 + count.index)
  tags              = merge(local.tags, { Name = "${local.name}-private-${local.azs[count.index]}" })
}

resource "aws_route_table" "public" {
  vpc_id = aws_vpc.this.id
  tags   = merge(local.tags, { Name = "${local.name}-public" })
}

resource "aws_route" "public_internet" {
  route_table_id         = aws_route_table.public.id
  destination_cidr_block = "0.0.0.0/0"
  gateway_id             = aws_internet_gateway.this.id
}

resource "aws_route_table_association" "public" {
  count = var.az_count

  subnet_id      = aws_subnet.public[count.index].id
  route_table_id = aws_route_table.public.id
}

resource "aws_eip" "nat" {
  count = var.create_nat_gateway ? 1 : 0

  domain = "vpc"
  tags   = merge(local.tags, { Name = "${local.name}-nat" })
}

resource "aws_nat_gateway" "this" {
  count = var.create_nat_gateway ? 1 : 0

  allocation_id = aws_eip.nat[0].id
  subnet_id     = aws_subnet.public[0].id
  tags          = merge(local.tags, { Name = local.name })
}

resource "aws_route_table" "private" {
  vpc_id = aws_vpc.this.id
  tags   = merge(local.tags, { Name = "${local.name}-private" })
}

resource "aws_route" "private_nat" {
  count = var.create_nat_gateway ? 1 : 0

  route_table_id         = aws_route_table.private.id
  destination_cidr_block = "0.0.0.0/0"
  nat_gateway_id         = aws_nat_gateway.this[0].id
}

resource "aws_route_table_association" "private" {
  count = var.az_count

  subnet_id      = aws_subnet.private[count.index].id
  route_table_id = aws_route_table.private.id
}

# --- security groups ----------------------------------------------------------------

resource "aws_security_group" "lb" {
  name        = "${local.name}-lb"
  description = "fedgate backend load balancer: AMQP from the gateways, management from admins"
  vpc_id      = aws_vpc.this.id
  tags        = merge(local.tags, { Name = "${local.name}-lb" })

  ingress {
    description = "AMQP/AMQPS from the gateways (their downlink links)"
    from_port   = 5671
    to_port     = 5672
    protocol    = "tcp"
    cidr_blocks = var.gateway_cidr_blocks
  }

  ingress {
    description = "management API from the admin network (HTTPS with node TLS)"
    from_port   = local.management_lb_port
    to_port     = local.management_lb_port
    protocol    = "tcp"
    cidr_blocks = var.admin_cidr_blocks
  }

  egress {
    description = "to the backend nodes"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = [var.vpc_cidr]
  }
}

resource "aws_security_group" "backend" {
  name        = "${local.name}-nodes"
  description = "fedgate backend RabbitMQ nodes"
  vpc_id      = aws_vpc.this.id
  tags        = merge(local.tags, { Name = "${local.name}-nodes" })

  ingress {
    description     = "AMQP/AMQPS and management through the load balancer"
    from_port       = 5671
    to_port         = 15672
    protocol        = "tcp"
    security_groups = [aws_security_group.lb.id]
  }

  ingress {
    description = "AMQP from inside the VPC (routers)"
    from_port   = 5671
    to_port     = 5672
    protocol    = "tcp"
    cidr_blocks = [var.vpc_cidr]
  }

  # the routers, through the internal load balancer (services.tf)
  dynamic "ingress" {
    for_each = local.deploy_routers ? { "AMQP" = 5672, "management API" = 15672 } : {}
    content {
      description     = "${ingress.key} from the routers"
      from_port       = ingress.value
      to_port         = ingress.value
      protocol        = "tcp"
      security_groups = [aws_security_group.routers[0].id]
    }
  }

  ingress {
    description = "Erlang distribution, epmd and CLI tools within the cluster"
    from_port   = 0
    to_port     = 65535
    protocol    = "tcp"
    self        = true
  }

  egress {
    description = "federation links to the gateways, packages, the AWS API"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

resource "aws_security_group" "kafka" {
  count = var.create_kafka ? 1 : 0

  name        = "${local.name}-kafka"
  description = "fedgate Kafka brokers: clients from inside the VPC only"
  vpc_id      = aws_vpc.this.id
  tags        = merge(local.tags, { Name = "${local.name}-kafka" })

  ingress {
    description = "Kafka over TLS with SASL/SCRAM from the VPC"
    from_port   = 9096
    to_port     = 9096
    protocol    = "tcp"
    cidr_blocks = [var.vpc_cidr]
  }

  egress {
    description = "within the VPC"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = [var.vpc_cidr]
  }
}

# --- backend RabbitMQ cluster ---------------------------------------------------------

module "nodes" {
  source = "../rabbitmq-nodes"

  name = "${local.name}-nodes"
  tags = local.tags
  rabbitmq_conf = join("", [templatestring(var.rabbitmq_conf_template, {
    cluster_name    = "fedgate-backend"
    host            = "0.0.0.0"
    amqp_port       = 5672
    management_port = 15672
    prometheus_port = 15692
    memory_mb       = var.memory_mb
    admin_user      = "fedgate-admin"
    admin_password  = var.admin_password
  }), local.tls_conf])
  tls_files = local.node_tls ? {
    ca_pem   = var.node_tls.ca_pem
    cert_pem = var.node_tls.cert_pem
    key_pem  = var.node_tls_key_pem
  } : null
  enabled_plugins    = var.enabled_plugins
  erlang_cookie      = var.erlang_cookie
  ami_id             = var.ami_id
  ami_owners         = var.ami_owners
  ami_name_filter    = var.ami_name_filter
  instance_type      = var.instance_type
  node_count         = var.node_count
  allow_single_node  = var.allow_single_node
  subnet_ids         = aws_subnet.private[*].id
  security_group_ids = [aws_security_group.backend.id]
  target_group_arns = concat(
    [aws_lb_target_group.amqp.arn, aws_lb_target_group.management.arn],
    aws_lb_target_group.amqps[*].arn,
    [for tg in aws_lb_target_group.internal : tg.arn],
  )
}

resource "aws_lb" "this" {
  name               = substr("${local.name}-amqp", 0, 32)
  load_balancer_type = "network"
  internal           = false
  subnets            = aws_subnet.public[*].id
  security_groups    = [aws_security_group.lb.id]
  tags               = local.tags
}

resource "aws_lb_target_group" "amqp" {
  name                 = substr("${local.name}-amqp", 0, 32)
  port                 = 5672
  protocol             = "TCP"
  vpc_id               = aws_vpc.this.id
  deregistration_delay = 60
  tags                 = local.tags
}

resource "aws_lb_target_group" "management" {
  name     = substr("${local.name}-mgmt", 0, 32)
  port     = local.management_lb_port
  protocol = "TCP"
  vpc_id   = aws_vpc.this.id
  tags     = local.tags
}

resource "aws_lb_listener" "amqp" {
  load_balancer_arn = aws_lb.this.arn
  port              = 5672
  protocol          = "TCP"

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.amqp.arn
  }
}

# AMQPS passed through to the nodes: the gateways check the node's own certificate.
resource "aws_lb_target_group" "amqps" {
  count = local.node_tls ? 1 : 0

  name                 = substr("${local.name}-amqps", 0, 32)
  port                 = 5671
  protocol             = "TCP"
  vpc_id               = aws_vpc.this.id
  deregistration_delay = 60
  tags                 = local.tags

  lifecycle {
    precondition {
      condition     = var.node_tls_key_pem != null
      error_message = "node_tls needs node_tls_key_pem."
    }
  }
}

resource "aws_lb_listener" "amqps" {
  count = local.node_tls ? 1 : 0

  load_balancer_arn = aws_lb.this.arn
  port              = 5671
  protocol          = "TCP"

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.amqps[0].arn
  }
}

resource "aws_lb_listener" "management" {
  load_balancer_arn = aws_lb.this.arn
  port              = local.management_lb_port
  protocol          = "TCP"

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.management.arn
  }
}

# --- Kafka (Amazon MSK) -------------------------------------------------------------------

locals {
  # Every record the router bridges is acked to the gateway only after Kafka has it
  # (acks=all): with 3 replicas and 2 in sync, a write survives the loss of a broker
  # and the topic stays writable while one broker is down (a rolling MSK patch).
  kafka_replication_factor  = 3
  kafka_min_insync_replicas = 2
  kafka_brokers             = var.az_count * var.kafka_brokers_per_az
  #: the SCRAM user of fedgate's Kafka clients (routers, the Spark job)
  kafka_user = "fedgate"
}

resource "aws_msk_configuration" "this" {
  count = var.create_kafka ? 1 : 0

  name           = local.name
  kafka_versions = [var.kafka_version]
  description    = "fedgate: replication ${local.kafka_replication_factor}, ${local.kafka_min_insync_replicas} in sync, topics created by the router"

  # The router creates its topics ahead of time with the partitions it shards by;
  # a topic auto-created by a typo would take Kafka's defaults. Kafka's own topics
  # (consumer offsets, transactions) get the same replication as fedgate's, and no
  # out-of-sync replica may become leader (it would drop acknowledged records).
  server_properties = <<-EOT
    auto.create.topics.enable = false
    default.replication.factor = ${local.kafka_replication_factor}
    min.insync.replicas = ${local.kafka_min_insync_replicas}
    offsets.topic.replication.factor = ${local.kafka_replication_factor}
    transaction.state.log.replication.factor = ${local.kafka_replication_factor}
    transaction.state.log.min.isr = ${local.kafka_min_insync_replicas}
    unclean.leader.election.enable = false
  EOT
}

resource "aws_msk_cluster" "this" {
  count = var.create_kafka ? 1 : 0

  cluster_name           = local.name
  kafka_version          = var.kafka_version
  number_of_broker_nodes = local.kafka_brokers
  tags                   = local.tags

  configuration_info {
    arn      = aws_msk_configuration.this[0].arn
    revision = aws_msk_configuration.this[0].latest_revision
  }

  lifecycle {
    precondition {
      condition     = local.kafka_brokers >= local.kafka_replication_factor
      error_message = "Kafka replicates every partition ${local.kafka_replication_factor} times: az_count x kafka_brokers_per_az must be at least ${local.kafka_replication_factor} (e.g. az_count = 2 with kafka_brokers_per_az = 2)."
    }
    precondition {
      condition     = var.kafka_sasl_password != null
      error_message = "kafka_sasl_password: required with create_kafka (fedgate backend-tls writes it to backend-secrets.auto.tfvars.json)."
    }
  }

  broker_node_group_info {
    instance_type   = var.kafka_instance_type
    client_subnets  = aws_subnet.private[*].id
    security_groups = [aws_security_group.kafka[0].id]

    storage_info {
      ebs_storage_info {
        volume_size = var.kafka_volume_gb
      }
    }
  }

  # Clients log in with SASL/SCRAM over TLS (port 9096): the routers and the Spark job as
  # local.kafka_user; no unauthenticated listener.
  client_authentication {
    sasl {
      scram = true
    }
    unauthenticated = false
  }

  encryption_info {
    encryption_in_transit {
      client_broker = "TLS"
      in_cluster    = true
    }
  }

}

# MSK reads SCRAM users from Secrets Manager secrets named AmazonMSK_*, encrypted with a
# customer managed key.
resource "aws_kms_key" "kafka" {
  count = var.create_kafka ? 1 : 0

  description             = "${local.name}: Kafka SCRAM secrets"
  deletion_window_in_days = 7
  tags                    = local.tags
}

resource "aws_secretsmanager_secret" "kafka_user" {
  count = var.create_kafka ? 1 : 0

  name       = "AmazonMSK_${local.name}-${local.kafka_user}"
  kms_key_id = aws_kms_key.kafka[0].key_id
  tags       = local.tags
}

resource "aws_secretsmanager_secret_version" "kafka_user" {
  count = var.create_kafka ? 1 : 0

  secret_id     = aws_secretsmanager_secret.kafka_user[0].id
  secret_string = jsonencode({ username = local.kafka_user, password = var.kafka_sasl_password })
}

resource "aws_msk_scram_secret_association" "this" {
  count = var.create_kafka ? 1 : 0

  cluster_arn     = aws_msk_cluster.this[0].arn
  secret_arn_list = [aws_secretsmanager_secret.kafka_user[0].arn]

  depends_on = [aws_secretsmanager_secret_version.kafka_user]
}

# --- analytics bucket -----------------------------------------------------------------------

resource "aws_s3_bucket" "analytics" {
  bucket        = var.analytics_bucket_name
  force_destroy = var.analytics_bucket_force_destroy
  tags          = local.tags
}

resource "aws_s3_bucket_public_access_block" "analytics" {
  bucket                  = aws_s3_bucket.analytics.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "analytics" {
  bucket = aws_s3_bucket.analytics.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "analytics" {
  bucket = aws_s3_bucket.analytics.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm = "AES256"
    }
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "analytics" {
  bucket = aws_s3_bucket.analytics.id

  rule {
    id     = "expire-old-table-versions"
    status = "Enabled"

    filter {}

    noncurrent_version_expiration {
      noncurrent_days = var.analytics_noncurrent_days
    }
  }
}
