# One fedgate region: a VPC across availability zones, a RabbitMQ gateway
# cluster in an autoscaling group, a network load balancer for MQTT (and the
# backend's AMQP federation link), and a Route53 latency record with a health
# check under the fleet's one MQTT hostname.
#
# "Healthy" means a node whose RabbitMQ answers, not a kernel that completes a
# TCP handshake: a hung node (a stopped or wedged Erlang VM) keeps its listener
# and its kernel keeps accepting on 1883. So the load balancer checks each node
# over HTTP on RabbitMQ's Prometheus endpoint (15692, /metrics), which the VM
# itself serves, and Route53 follows the load balancer's count of healthy nodes
# through a CloudWatch alarm.

data "aws_region" "current" {}

data "aws_availability_zones" "available" {
  state = "available"
}

locals {
  name = "${var.name_prefix}-${var.region}"
  azs  = slice(data.aws_availability_zones.available.names, 0, var.az_count)
  tags = merge({ "fedgate:region" = var.region, "fedgate:role" = "gateway" }, var.tags)

  # Ports of a cloud node: the standard ones (each node has its own host).
  mqtt_port       = 1883
  mqtts_port      = 8883
  amqp_port       = 5672
  amqps_port      = 5671
  management_port = 15672
  prometheus_port = 15692
  # RabbitMQ's aggregated metrics: unauthenticated, and answered by the node's own VM
  health_check_path = "/metrics"
  # the routers and operators reach the management API through the load balancer: over
  # HTTPS with node TLS (the plain listener is then for the node itself only)
  management_tls_port = 15671
  management_lb_port  = var.node_tls != null ? local.management_tls_port : local.management_port

  # TLS on the nodes: AMQPS for the backend's links, and MQTT over TLS unless
  # the load balancer terminates it (certificate_arn).
  node_tls       = var.node_tls != null
  mqtts_on_nodes = local.node_tls && var.certificate_arn == null
  tls_dir        = "/etc/rabbitmq/tls"
  server_name    = local.node_tls ? var.node_tls.server_name : null
  tls_conf = local.node_tls ? templatestring(var.tls_conf_template, {
    host                = "0.0.0.0"
    amqps_port          = local.amqps_port
    management_tls_port = local.management_tls_port
    cacertfile          = "${local.tls_dir}/ca.pem"
    certfile            = "${local.tls_dir}/cert.pem"
    keyfile             = "${local.tls_dir}/key.pem"
    mqtts_listener      = local.mqtts_on_nodes ? "mqtt.listeners.ssl.1 = 0.0.0.0:${local.mqtts_port}" : ""
  }) : ""
}

# --- network -------------------------------------------------------------------

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

# Public subnets only: no NAT gateway to pay for. Nodes get public addresses
# for package installs; the security groups decide who may talk to them.
resource "aws_subnet" "public" {
  count = var.az_count

  vpc_id                  = aws_vpc.this.id
  availability_zone       = local.azs[count.index]
  cidr_block              = cidrsubnet(var.vpc_cidr, 8, count.index)
  map_public_ip_on_launch = true
  tags                    = merge(local.tags, { Name = "${local.name}-${local.azs[count.index]}" })
}

resource "aws_route_table" "public" {
  vpc_id = aws_vpc.this.id
  tags   = merge(local.tags, { Name = "${local.name}-public" })
}

resource "aws_route" "internet" {
  route_table_id         = aws_route_table.public.id
  destination_cidr_block = "0.0.0.0/0"
  gateway_id             = aws_internet_gateway.this.id
}

resource "aws_route_table_association" "public" {
  count = var.az_count

  subnet_id      = aws_subnet.public[count.index].id
  route_table_id = aws_route_table.public.id
}

# --- security groups ------------------------------------------------------------

# The load balancer: MQTT from devices, AMQP only from the backend (its
# federation links pull uplink and presence from the gateways).
resource "aws_security_group" "lb" {
  name        = "${local.name}-lb"
  description = "fedgate ${var.region} load balancer: MQTT from devices, AMQP from the backend"
  vpc_id      = aws_vpc.this.id
  tags        = merge(local.tags, { Name = "${local.name}-lb" })

  ingress {
    description = "MQTT from devices"
    from_port   = local.mqtt_port
    to_port     = local.mqtt_port
    protocol    = "tcp"
    cidr_blocks = var.device_cidr_blocks
  }

  ingress {
    description = "MQTT over TLS from devices"
    from_port   = local.mqtts_port
    to_port     = local.mqtts_port
    protocol    = "tcp"
    cidr_blocks = var.device_cidr_blocks
  }

  ingress {
    description = "AMQP/AMQPS federation links from the backend"
    from_port   = local.amqps_port
    to_port     = local.amqp_port
    protocol    = "tcp"
    cidr_blocks = var.backend_cidr_blocks
  }

  ingress {
    description = "management API: the backend routers (presence, subscriptions) and operators"
    from_port   = local.management_lb_port
    to_port     = local.management_lb_port
    protocol    = "tcp"
    cidr_blocks = distinct(concat(var.backend_cidr_blocks, var.admin_cidr_blocks))
  }

  egress {
    description = "to the gateway nodes"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = [var.vpc_cidr]
  }
}

resource "aws_security_group" "gateway" {
  name        = "${local.name}-gateway"
  description = "fedgate ${var.region} gateway nodes"
  vpc_id      = aws_vpc.this.id
  tags        = merge(local.tags, { Name = "${local.name}-gateway" })

  ingress {
    description     = "MQTT through the load balancer"
    from_port       = local.mqtt_port
    to_port         = local.mqtt_port
    protocol        = "tcp"
    security_groups = [aws_security_group.lb.id]
  }

  ingress {
    description     = "health checks from the load balancer: RabbitMQ Prometheus endpoint (answered by the node VM itself)"
    from_port       = local.prometheus_port
    to_port         = local.prometheus_port
    protocol        = "tcp"
    security_groups = [aws_security_group.lb.id]
  }

  ingress {
    description     = "MQTT over TLS through the load balancer (passed through to the nodes)"
    from_port       = local.mqtts_port
    to_port         = local.mqtts_port
    protocol        = "tcp"
    security_groups = [aws_security_group.lb.id]
  }

  ingress {
    description     = "AMQP/AMQPS through the load balancer"
    from_port       = local.amqps_port
    to_port         = local.amqp_port
    protocol        = "tcp"
    security_groups = [aws_security_group.lb.id]
  }

  ingress {
    description = "AMQP/AMQPS straight from the backend"
    from_port   = local.amqps_port
    to_port     = local.amqp_port
    protocol    = "tcp"
    cidr_blocks = var.backend_cidr_blocks
  }

  ingress {
    description     = "management API through the load balancer (backend routers, operators)"
    from_port       = local.management_lb_port
    to_port         = local.management_lb_port
    protocol        = "tcp"
    security_groups = [aws_security_group.lb.id]
  }

  ingress {
    description = "management API and UI from the admin network only"
    from_port   = local.management_lb_port
    to_port     = local.management_lb_port
    protocol    = "tcp"
    cidr_blocks = var.admin_cidr_blocks
  }

  ingress {
    description = "Erlang distribution and epmd between the nodes of this cluster"
    from_port   = 4369
    to_port     = 4369
    protocol    = "tcp"
    self        = true
  }

  ingress {
    description = "Erlang distribution between the nodes of this cluster"
    from_port   = 25672
    to_port     = 25672
    protocol    = "tcp"
    self        = true
  }

  ingress {
    description = "CLI tools between the nodes of this cluster"
    from_port   = 35672
    to_port     = 35682
    protocol    = "tcp"
    self        = true
  }

  egress {
    description = "AMQP/AMQPS toward the backend only (the downlink federation link)"
    from_port   = local.amqps_port
    to_port     = local.amqp_port
    protocol    = "tcp"
    cidr_blocks = var.backend_cidr_blocks
  }

  egress {
    description = "HTTPS: Debian packages and the AWS API (peer discovery)"
    from_port   = 443
    to_port     = 443
    protocol    = "tcp"
    cidr_blocks = ["0.0.0.0/0"]
  }

  egress {
    description = "HTTP: Debian package mirrors"
    from_port   = 80
    to_port     = 80
    protocol    = "tcp"
    cidr_blocks = ["0.0.0.0/0"]
  }

  egress {
    description = "Erlang distribution within the cluster"
    from_port   = 0
    to_port     = 65535
    protocol    = "tcp"
    self        = true
  }
}

# --- gateway nodes ----------------------------------------------------------------

# The same templates the local driver renders (gateways/templates); the
# definitions hold the gateway's side of the federation link to the backend.
module "nodes" {
  source = "../rabbitmq-nodes"

  name = "${local.name}-gateway"
  tags = local.tags
  rabbitmq_conf = join("", [templatestring(var.rabbitmq_conf_template, {
    region          = var.region
    cluster_name    = var.region
    host            = "0.0.0.0"
    mqtt_host       = "0.0.0.0"
    amqp_port       = local.amqp_port
    management_port = local.management_port
    prometheus_port = local.prometheus_port
    mqtt_port       = local.mqtt_port
    mqtt_tcp_buffer = var.mqtt_tcp_buffer
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
  definitions        = var.rabbitmq_definitions
  max_fds            = var.max_fds
  erl_args           = trimspace(var.erl_args)
  erlang_plugins     = var.erlang_plugins
  ami_id             = var.ami_id
  ami_owners         = var.ami_owners
  ami_name_filter    = var.ami_name_filter
  instance_type      = var.instance_type
  node_count         = var.node_count
  allow_single_node  = var.allow_single_node
  subnet_ids         = aws_subnet.public[*].id
  security_group_ids = [aws_security_group.gateway.id]
  target_group_arns = concat(
    [aws_lb_target_group.mqtt.arn, aws_lb_target_group.amqp.arn, aws_lb_target_group.management.arn],
    aws_lb_target_group.amqps[*].arn,
    aws_lb_target_group.mqtts[*].arn,
  )
}

# --- load balancer ------------------------------------------------------------------

resource "aws_lb" "this" {
  name                             = substr("${local.name}-gw", 0, 32)
  load_balancer_type               = "network"
  internal                         = false
  subnets                          = aws_subnet.public[*].id
  security_groups                  = [aws_security_group.lb.id]
  enable_cross_zone_load_balancing = true
  tags                             = local.tags
}

resource "aws_lb_target_group" "mqtt" {
  name     = substr("${local.name}-mqtt", 0, 32)
  port     = local.mqtt_port
  protocol = "TCP"
  vpc_id   = aws_vpc.this.id
  tags     = local.tags

  # Long-lived device connections: give them time to move on a scale-in.
  deregistration_delay = 60

  # Not a TCP check of 1883: a hung node's kernel completes that handshake.
  health_check {
    protocol            = "HTTP"
    port                = tostring(local.prometheus_port)
    path                = local.health_check_path
    matcher             = "200"
    interval            = var.health_check_interval
    timeout             = var.health_check_timeout
    healthy_threshold   = var.health_check_healthy_threshold
    unhealthy_threshold = var.health_check_failure_threshold
  }
}

resource "aws_lb_target_group" "amqp" {
  name                 = substr("${local.name}-amqp", 0, 32)
  port                 = local.amqp_port
  protocol             = "TCP"
  vpc_id               = aws_vpc.this.id
  deregistration_delay = 60
  tags                 = local.tags

  health_check {
    protocol = "TCP"
    port     = tostring(local.amqp_port)
  }
}

# TLS to the nodes, passed through: the backend checks the node's own
# certificate, so the load balancer must not terminate AMQPS.
resource "aws_lb_target_group" "amqps" {
  count = local.node_tls ? 1 : 0

  lifecycle {
    precondition {
      condition     = var.node_tls_key_pem != null
      error_message = "node_tls needs node_tls_key_pem."
    }
  }

  name                 = substr("${local.name}-amqps", 0, 32)
  port                 = local.amqps_port
  protocol             = "TCP"
  vpc_id               = aws_vpc.this.id
  deregistration_delay = 60
  tags                 = local.tags

  health_check {
    protocol = "TCP"
    port     = tostring(local.amqps_port)
  }
}

resource "aws_lb_target_group" "mqtts" {
  count = local.mqtts_on_nodes ? 1 : 0

  name                 = substr("${local.name}-mqtts", 0, 32)
  port                 = local.mqtts_port
  protocol             = "TCP"
  vpc_id               = aws_vpc.this.id
  deregistration_delay = 60
  tags                 = local.tags

  # the same nodes as MQTT's: the same check (devices over TLS reach a hung node just the same)
  health_check {
    protocol            = "HTTP"
    port                = tostring(local.prometheus_port)
    path                = local.health_check_path
    matcher             = "200"
    interval            = var.health_check_interval
    timeout             = var.health_check_timeout
    healthy_threshold   = var.health_check_healthy_threshold
    unhealthy_threshold = var.health_check_failure_threshold
  }
}

resource "aws_lb_listener" "amqps" {
  count = local.node_tls ? 1 : 0

  load_balancer_arn = aws_lb.this.arn
  port              = local.amqps_port
  protocol          = "TCP"
  tags              = local.tags

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.amqps[0].arn
  }
}

resource "aws_lb_listener" "mqtts_passthrough" {
  count = local.mqtts_on_nodes ? 1 : 0

  load_balancer_arn = aws_lb.this.arn
  port              = local.mqtts_port
  protocol          = "TCP"
  tags              = local.tags

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.mqtts[0].arn
  }
}

resource "aws_lb_listener" "mqtt" {
  load_balancer_arn = aws_lb.this.arn
  port              = local.mqtt_port
  protocol          = "TCP"
  tags              = local.tags

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.mqtt.arn
  }
}

resource "aws_lb_listener" "mqtts" {
  count = var.certificate_arn == null ? 0 : 1

  load_balancer_arn = aws_lb.this.arn
  port              = local.mqtts_port
  protocol          = "TLS"
  certificate_arn   = var.certificate_arn
  ssl_policy        = "ELBSecurityPolicy-TLS13-1-2-2021-06"
  tags              = local.tags

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.mqtt.arn
  }
}

resource "aws_lb_listener" "amqp" {
  load_balancer_arn = aws_lb.this.arn
  port              = local.amqp_port
  protocol          = "TCP"
  tags              = local.tags

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.amqp.arn
  }
}

# The management API for the backend's routers, which read the region's connections and
# subscriptions (presence) through it, at an address that outlives the nodes.
resource "aws_lb_target_group" "management" {
  name     = substr("${local.name}-mgmt", 0, 32)
  port     = local.management_lb_port
  protocol = "TCP"
  vpc_id   = aws_vpc.this.id
  tags     = local.tags
}

resource "aws_lb_listener" "management" {
  load_balancer_arn = aws_lb.this.arn
  port              = local.management_lb_port
  protocol          = "TCP"
  tags              = local.tags

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.management.arn
  }
}

# --- latency DNS ----------------------------------------------------------------------

# Route53 answers the fleet's MQTT hostname with the lowest-latency region
# whose health check passes: devices find their nearest healthy gateway. Its
# own checkers could only reach the load balancer's public listeners, whose TCP
# handshake a hung node completes; so the region's health is the load
# balancer's count of nodes that pass their HTTP check, read by this alarm.
resource "aws_cloudwatch_metric_alarm" "mqtt_healthy_nodes" {
  count = var.create_dns_record ? 1 : 0

  alarm_name        = "${local.name}-mqtt-healthy-nodes"
  alarm_description = "No gateway node of ${var.region} passes the load balancer's health check: Route53 stops answering the region's latency record."
  namespace         = "AWS/NetworkELB"
  metric_name       = "HealthyHostCount"
  dimensions = {
    LoadBalancer = aws_lb.this.arn_suffix
    TargetGroup  = aws_lb_target_group.mqtt.arn_suffix
  }
  # Maximum: alarm only when no report of the minute saw a healthy node (each
  # availability zone's load balancer node reports its own count).
  statistic           = "Maximum"
  period              = 60
  evaluation_periods  = var.health_check_alarm_minutes
  comparison_operator = "LessThanThreshold"
  threshold           = 1
  # A late datapoint neither fails nor passes the region; data that stopped
  # altogether makes the alarm INSUFFICIENT_DATA, which the health check reads.
  treat_missing_data = "missing"
  tags               = local.tags
}

resource "aws_route53_health_check" "this" {
  count = var.create_dns_record ? 1 : 0

  type                    = "CLOUDWATCH_METRIC"
  cloudwatch_alarm_name   = aws_cloudwatch_metric_alarm.mqtt_healthy_nodes[0].alarm_name
  cloudwatch_alarm_region = data.aws_region.current.name
  # Unhealthy, not LastKnownStatus: a region just applied has no datapoint yet
  # (its nodes still boot), and a new check without a last status counts as
  # healthy; a region whose load balancer reports nothing is not answered.
  # When every region is unhealthy Route53 answers them all anyway, so this
  # can never leave a device without an answer.
  insufficient_data_health_status = "Unhealthy"
  tags                            = merge(local.tags, { Name = "${local.name}-mqtt" })

  # a new check (one replacing the TCP check of earlier versions) is in place
  # before the old one goes: Route53 refuses to delete a check a record uses
  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_route53_record" "mqtt" {
  count = var.create_dns_record ? 1 : 0

  zone_id         = var.zone_id
  name            = var.mqtt_hostname
  type            = "CNAME"
  ttl             = var.dns_ttl
  records         = [aws_lb.this.dns_name]
  set_identifier  = var.region
  health_check_id = aws_route53_health_check.this[0].id

  latency_routing_policy {
    region = data.aws_region.current.name
  }

  lifecycle {
    precondition {
      condition     = var.zone_id != null && var.mqtt_hostname != null
      error_message = "create_dns_record needs zone_id and mqtt_hostname."
    }
  }
}
