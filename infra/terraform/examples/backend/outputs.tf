output "management_url" {
  description = "Management API of the backend (FEDGATE_CLOUD_BACKEND_MANAGEMENT_URL)."
  value       = module.backend.management_url
}

output "amqp_endpoint" {
  description = "AMQP endpoint the gateways' downlink links connect to."
  value       = module.backend.amqp_endpoint
}

output "egress_cidr_blocks" {
  description = "The backend's egress addresses (the gateways' backend_cidr_blocks)."
  value       = module.backend.egress_cidr_blocks
}

output "kafka_bootstrap_brokers_sasl_scram" {
  description = "MSK bootstrap brokers (TLS, SASL/SCRAM user fedgate)."
  value       = module.backend.kafka_bootstrap_brokers_sasl_scram
}

output "routers_autoscaling_group_name" {
  description = "Autoscaling group of the routers (null without fedgate_release_wheel)."
  value       = module.backend.routers_autoscaling_group_name
}

output "analytics_bucket" {
  description = "Name of the analytics bucket."
  value       = module.backend.analytics_bucket
}
