# The routers, deployed from a fedgate release (fedgate-service module) when
# fedgate_release is set. They reach the backend nodes through an internal load
# balancer (AMQP and the management API, never leaving the VPC), Kafka over TLS with
# SASL/SCRAM, and read their passwords from Secrets Manager at boot.

locals {
  deploy_routers         = var.fedgate_release != null
  router_port            = 9100 # metrics, /presence, /regions, /health
  router_kafka_bootstrap = var.create_kafka ? try(aws_msk_cluster.this[0].bootstrap_brokers_sasl_scram, "") : coalesce(var.kafka_bootstrap, "")
  internal_host          = local.deploy_routers ? aws_lb.internal[0].dns_name : ""

  # router/settings.py; secrets come from the environment (the secret below)
  router_toml = join("\n", [
    "# rendered by fedgate's backend Terraform module; passwords come from the environment",
    "kafka_bootstrap = ${jsonencode(local.router_kafka_bootstrap)}",
    "kafka_security_protocol = \"SASL_SSL\"",
    "kafka_sasl_mechanism = \"SCRAM-SHA-512\"",
    "kafka_sasl_username = ${jsonencode(local.kafka_user)}",
    "kafka_replication = ${local.kafka_replication_factor}",
    # instances of an autoscaling group have no index: the shards go to the running routers by
    # rendezvous hashing of their ids (router/shards.py)
    "shard_owner = \"rendezvous\"",
    # the gateways' monitoring user cannot look devices up (an administrator call): a command
    # for a device never seen waits for it, parked, rather than being broadcast and dropped
    "unknown_device = \"park\"",
    "metrics_host = \"0.0.0.0\"",
    "metrics_port = ${local.router_port}",
    var.router_config_extra,
    "",
    "[backend_management]",
    "management_url = ${jsonencode("http://${local.internal_host}:15672")}",
    "user = \"fedgate-admin\"",
    "",
  ])
}

resource "aws_security_group" "routers" {
  count = local.deploy_routers ? 1 : 0

  lifecycle {
    precondition {
      condition     = var.router_password != null && var.kafka_sasl_password != null
      error_message = "router_password and kafka_sasl_password: required to deploy the routers (fedgate backend-tls writes them to backend-secrets.auto.tfvars.json)."
    }
    precondition {
      condition     = var.create_kafka || var.kafka_bootstrap != null
      error_message = "kafka_bootstrap: required to deploy the routers without create_kafka."
    }
  }

  name        = "${local.name}-routers"
  description = "fedgate routers: metrics from the VPC; out to the backend, Kafka, S3 and PyPI"
  vpc_id      = aws_vpc.this.id
  tags        = merge(local.tags, { Name = "${local.name}-routers" })

  ingress {
    description = "metrics, presence and health from the VPC (Prometheus, operator bastions)"
    from_port   = local.router_port
    to_port     = local.router_port
    protocol    = "tcp"
    cidr_blocks = [var.vpc_cidr]
  }

  egress {
    description = "the backend nodes, Kafka, S3, Secrets Manager, PyPI (through the NAT gateway)"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

# The routers' way to the backend nodes: an internal load balancer (its clients' addresses
# preserved, so the nodes' security group admits the routers' group: main.tf).
resource "aws_lb" "internal" {
  count = local.deploy_routers ? 1 : 0

  name               = substr("${local.name}-int", 0, 32)
  load_balancer_type = "network"
  internal           = true
  subnets            = aws_subnet.private[*].id
  tags               = local.tags
}

resource "aws_lb_target_group" "internal" {
  for_each = local.deploy_routers ? { amqp = 5672, mgmt = 15672 } : {}

  name                 = substr("${local.name}-int-${each.key}", 0, 32)
  port                 = each.value
  protocol             = "TCP"
  vpc_id               = aws_vpc.this.id
  deregistration_delay = 30
  tags                 = local.tags
}

resource "aws_lb_listener" "internal" {
  for_each = local.deploy_routers ? { amqp = 5672, mgmt = 15672 } : {}

  load_balancer_arn = aws_lb.internal[0].arn
  port              = each.value
  protocol          = "TCP"

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.internal[each.key].arn
  }
}

resource "aws_secretsmanager_secret" "router" {
  count = local.deploy_routers ? 1 : 0

  name = "${local.name}-router"
  tags = local.tags
}

resource "aws_secretsmanager_secret_version" "router" {
  count = local.deploy_routers ? 1 : 0

  secret_id = aws_secretsmanager_secret.router[0].id
  secret_string = jsonencode({
    FEDGATE_ROUTER_AMQP_URL                    = "amqp://fedgate-router:${urlencode(coalesce(var.router_password, "-"))}@${local.internal_host}:5672/%2F"
    FEDGATE_ROUTER_KAFKA_SASL_PASSWORD         = coalesce(var.kafka_sasl_password, "-")
    FEDGATE_ROUTER_BACKEND_MANAGEMENT_PASSWORD = var.admin_password
  })
}

module "routers" {
  source = "../fedgate-service"
  count  = local.deploy_routers ? 1 : 0

  name               = "${local.name}-router"
  tags               = local.tags
  service            = "router"
  instance_count     = var.router_count
  instance_type      = var.router_instance_type
  subnet_ids         = aws_subnet.private[*].id
  security_group_ids = [aws_security_group.routers[0].id]
  release_bucket     = var.fedgate_release.bucket
  release_key        = var.fedgate_release.key
  config_toml        = local.router_toml
  secret_arn         = aws_secretsmanager_secret_version.router[0].arn
  ami_id             = var.ami_id
  ami_owners         = var.ami_owners
  ami_name_filter    = var.ami_name_filter
}
