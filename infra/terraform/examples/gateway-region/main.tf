# One gateway region with its latency record, in a zone this example creates
# unless zone_id names an existing one.

provider "aws" {
  region = var.aws_region
}

# This example lives in the fedgate repository and takes the gateway's files from
# there; the module itself reads nothing outside its folder.
locals {
  gateways    = "${path.module}/../../../../gateways"
  auth_plugin = "${local.gateways}/mqtt_auth_plugin"
}

resource "aws_route53_zone" "this" {
  count = var.zone_id == null ? 1 : 0

  name = var.domain
}

module "gateway_region" {
  source = "../../modules/gateway-region"

  region              = var.aws_region
  ami_id              = var.ami_id
  admin_cidr_blocks   = var.admin_cidr_blocks
  backend_cidr_blocks = var.backend_cidr_blocks
  admin_password      = var.admin_password
  erlang_cookie       = var.erlang_cookie
  node_tls            = var.node_tls
  node_tls_key_pem    = var.node_tls_key_pem

  rabbitmq_conf_template = file("${local.gateways}/templates/rabbitmq.conf")
  tls_conf_template      = file("${local.gateways}/templates/tls.conf")
  enabled_plugins        = file("${local.gateways}/templates/enabled_plugins")
  erl_args               = file("${local.gateways}/templates/erl_args")
  # the gateway's authentication backend, built on each node
  erlang_plugins = {
    fedgate_mqtt_auth = {
      vsn     = regex("\\{vsn,\\s*\"([^\"]+)\"\\}", file("${local.auth_plugin}/fedgate_mqtt_auth.app"))[0]
      app     = file("${local.auth_plugin}/fedgate_mqtt_auth.app")
      sources = { for f in fileset("${local.auth_plugin}/src", "*.erl") : f => file("${local.auth_plugin}/src/${f}") }
    }
  }

  zone_id       = coalesce(var.zone_id, try(aws_route53_zone.this[0].zone_id, null))
  mqtt_hostname = "mqtt.${var.domain}"
}
