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

output "kafka_bootstrap_brokers_tls" {
  description = "MSK bootstrap brokers."
  value       = module.backend.kafka_bootstrap_brokers_tls
}

output "analytics_bucket" {
  description = "Name of the analytics bucket."
  value       = module.backend.analytics_bucket
}
