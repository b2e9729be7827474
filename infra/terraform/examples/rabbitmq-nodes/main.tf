# A bare RabbitMQ cluster of three nodes in one subnet, with fedgate's backend
# config: how gateway-region and backend use the rabbitmq-nodes module.

provider "aws" {
  region = var.aws_region
}

resource "aws_vpc" "this" {
  cidr_block = "10.60.0.0/16"
}

resource "aws_subnet" "this" {
  vpc_id     = aws_vpc.this.id
  cidr_block = "10.60.1.0/24"
}

resource "aws_security_group" "nodes" {
  name   = "rabbitmq-nodes-example"
  vpc_id = aws_vpc.this.id

  ingress {
    description = "everything between the nodes of the cluster"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    self        = true
  }
}

module "nodes" {
  source = "../../modules/rabbitmq-nodes"

  name = "rabbitmq-nodes-example"
  rabbitmq_conf = templatefile("${path.module}/../../../../backend/templates/rabbitmq.conf", {
    cluster_name    = "example"
    host            = "0.0.0.0"
    amqp_port       = 5672
    management_port = 15672
    prometheus_port = 15692
    memory_mb       = 1024
    admin_user      = "fedgate-admin"
    admin_password  = var.admin_password
  })
  enabled_plugins    = file("${path.module}/../../../../backend/templates/enabled_plugins")
  erlang_cookie      = var.erlang_cookie
  instance_type      = "t3.small"
  node_count         = 3
  subnet_ids         = [aws_subnet.this.id]
  security_group_ids = [aws_security_group.nodes.id]
}
