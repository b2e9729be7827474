# The backend of a small fleet: a 3-node RabbitMQ cluster, MSK with one broker
# per availability zone, and the analytics bucket.

provider "aws" {
  region = var.aws_region
}

# This example lives in the fedgate repository and takes the backend's templates
# from there; the module itself reads nothing outside its folder.
locals {
  repo = "${path.module}/../../../.."
}

module "backend" {
  source = "../../modules/backend"

  analytics_bucket_name = var.analytics_bucket_name
  admin_cidr_blocks     = var.admin_cidr_blocks
  # Gateways connect from their regions' public addresses; the links
  # authenticate per region (gw-<region> users) and may read only their own
  # downlink exchange.
  gateway_cidr_blocks = ["0.0.0.0/0"]
  admin_password      = var.admin_password
  erlang_cookie       = var.erlang_cookie

  rabbitmq_conf_template = file("${local.repo}/backend/templates/rabbitmq.conf")
  enabled_plugins        = file("${local.repo}/backend/templates/enabled_plugins")
  tls_conf_template      = file("${local.repo}/gateways/templates/tls.conf")

  # From `fedgate backend-tls` (backend-tls.auto.tfvars.json and
  # backend-secrets.auto.tfvars.json beside this file).
  node_tls            = var.node_tls
  node_tls_key_pem    = var.node_tls_key_pem
  router_password     = var.router_password
  kafka_sasl_password = var.kafka_sasl_password
  catalog_password    = var.catalog_password

  # MSK, unless you bring your own Kafka (SASL/SCRAM over TLS, user fedgate).
  create_kafka    = var.kafka_bootstrap == null
  kafka_bootstrap = var.kafka_bootstrap

  # The routers, and the Spark job with its jars, from `make release` (none without a wheel).
  fedgate_release = var.fedgate_release_wheel == null ? null : {
    bucket   = aws_s3_object.release[0].bucket
    key      = aws_s3_object.release[0].key
    jars_key = var.fedgate_spark_jars == null ? null : aws_s3_object.spark_jars[0].key
  }

  # a development stack: its catalog database goes with `terraform destroy`
  catalog_multi_az            = false
  catalog_deletion_protection = false
}

# The release the routers install, in a bucket of its own (the module reads no file).
resource "aws_s3_bucket" "releases" {
  count = var.fedgate_release_wheel == null ? 0 : 1

  bucket = "${var.analytics_bucket_name}-releases"
}

resource "aws_s3_object" "release" {
  count = var.fedgate_release_wheel == null ? 0 : 1

  bucket = aws_s3_bucket.releases[0].bucket
  key    = "fedgate/${basename(var.fedgate_release_wheel)}"
  source = var.fedgate_release_wheel
  etag   = filemd5(var.fedgate_release_wheel)
}

resource "aws_s3_object" "spark_jars" {
  count = var.fedgate_release_wheel == null || var.fedgate_spark_jars == null ? 0 : 1

  bucket = aws_s3_bucket.releases[0].bucket
  key    = "fedgate/${basename(var.fedgate_spark_jars)}"
  source = var.fedgate_spark_jars
  etag   = filemd5(var.fedgate_spark_jars)
}
