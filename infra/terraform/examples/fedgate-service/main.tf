# Two routers on an autoscaling group, from a fedgate release uploaded here: how the
# backend module deploys its routers and the Spark job with the fedgate-service module.
# The router's passwords live in a Secrets Manager secret, never in the launch template.

provider "aws" {
  region = var.aws_region
}

resource "aws_vpc" "this" {
  cidr_block = "10.61.0.0/16"
}

resource "aws_subnet" "this" {
  vpc_id     = aws_vpc.this.id
  cidr_block = "10.61.1.0/24"
}

resource "aws_security_group" "routers" {
  name   = "fedgate-service-example"
  vpc_id = aws_vpc.this.id

  egress {
    description = "the backend, Kafka, S3 and PyPI"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

resource "aws_s3_bucket" "releases" {
  bucket = var.release_bucket_name
}

# `make release` builds the wheel into build/release/
resource "aws_s3_object" "release" {
  bucket = aws_s3_bucket.releases.bucket
  key    = "fedgate/${basename(var.release_wheel)}"
  source = var.release_wheel
  etag   = filemd5(var.release_wheel)
}

resource "aws_secretsmanager_secret" "router" {
  name = "fedgate-service-example-router"
}

resource "aws_secretsmanager_secret_version" "router" {
  secret_id = aws_secretsmanager_secret.router.id
  secret_string = jsonencode({
    FEDGATE_ROUTER_AMQP_URL            = var.router_amqp_url
    FEDGATE_ROUTER_KAFKA_SASL_PASSWORD = var.kafka_sasl_password
  })
}

module "routers" {
  source = "../../modules/fedgate-service"

  name               = "fedgate-service-example-router"
  service            = "router"
  instance_count     = 2
  subnet_ids         = [aws_subnet.this.id]
  security_group_ids = [aws_security_group.routers.id]
  release_bucket     = aws_s3_bucket.releases.bucket
  release_key        = aws_s3_object.release.key
  secret_arn         = aws_secretsmanager_secret.router.arn
  config_toml        = <<-EOT
    kafka_bootstrap = "${var.kafka_bootstrap}"
    kafka_security_protocol = "SASL_SSL"
    kafka_sasl_mechanism = "SCRAM-SHA-512"
    kafka_sasl_username = "fedgate"
  EOT
}
