# One gateway region with its latency record, in a zone this example creates
# unless zone_id names an existing one.

provider "aws" {
  region = var.aws_region
}

resource "aws_route53_zone" "this" {
  count = var.zone_id == null ? 1 : 0

  name = var.domain
}

module "gateway_region" {
  source = "../../modules/gateway-region"

  region              = var.aws_region
  ami_id              = var.ami_id
  node_count          = 2
  admin_cidr_blocks   = var.admin_cidr_blocks
  backend_cidr_blocks = var.backend_cidr_blocks
  admin_password      = var.admin_password
  erlang_cookie       = var.erlang_cookie
  node_tls            = var.node_tls
  node_tls_key_pem    = var.node_tls_key_pem

  zone_id       = coalesce(var.zone_id, try(aws_route53_zone.this[0].zone_id, null))
  mqtt_hostname = "mqtt.${var.domain}"
}
