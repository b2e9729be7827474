output "vpc_id" {
  description = "ID of the backend's VPC."
  value       = aws_vpc.this.id
}

output "amqp_endpoint" {
  description = "Where the gateways' downlink links connect: the backend's load balancer, AMQPS (checked against server_name) with node_tls, else AMQP."
  value = {
    host        = aws_lb.this.dns_name
    port        = local.node_tls ? 5671 : 5672
    tls         = local.node_tls
    server_name = local.node_tls ? var.node_tls.server_name : null
  }
}

output "management_url" {
  description = "Management API of the backend cluster (FEDGATE_CLOUD_BACKEND_MANAGEMENT_URL for `make gateway`): HTTPS with node_tls, its certificate for node_tls.server_name."
  value       = "${local.node_tls ? "https" : "http"}://${aws_lb.this.dns_name}:${local.management_lb_port}"
}

output "egress_cidr_blocks" {
  description = "Addresses the backend's federation links come from: the gateways' backend_cidr_blocks (empty without a NAT gateway)."
  value       = var.create_nat_gateway ? ["${aws_eip.nat[0].public_ip}/32"] : []
}

output "autoscaling_group_name" {
  description = "Autoscaling group of the backend RabbitMQ nodes."
  value       = module.nodes.autoscaling_group_name
}

output "kafka_bootstrap_brokers_sasl_scram" {
  description = "MSK bootstrap brokers (TLS with SASL/SCRAM, user fedgate) for the routers, the Spark job and `fedgate` read-backs; null without create_kafka."
  value       = var.create_kafka ? aws_msk_cluster.this[0].bootstrap_brokers_sasl_scram : null
}

output "routers_autoscaling_group_name" {
  description = "Autoscaling group of the routers; null when they are not deployed (no fedgate_release)."
  value       = local.deploy_routers ? module.routers[0].autoscaling_group_name : null
}

output "internal_endpoint" {
  description = "The backend as the routers reach it inside the VPC: the internal load balancer's AMQP and management API; null when the routers are not deployed."
  value = local.deploy_routers ? {
    host            = aws_lb.internal[0].dns_name
    amqp_port       = 5672
    management_port = 15672
  } : null
}

output "kafka_topic_settings" {
  description = "Replication the MSK cluster is configured for: the router creates its topics with replication_factor and produces with acks=all (min_insync_replicas must acknowledge); null without create_kafka."
  value = var.create_kafka ? {
    replication_factor  = local.kafka_replication_factor
    min_insync_replicas = local.kafka_min_insync_replicas
  } : null
}

output "analytics_bucket" {
  description = "Name of the analytics bucket."
  value       = aws_s3_bucket.analytics.bucket
}

output "analytics_bucket_arn" {
  description = "ARN of the analytics bucket."
  value       = aws_s3_bucket.analytics.arn
}

output "spark_autoscaling_group_name" {
  description = "Autoscaling group of the Spark job; null when it is not deployed (no jars_key in fedgate_release)."
  value       = local.deploy_spark ? module.spark[0].autoscaling_group_name : null
}

output "catalog_jdbc_uri" {
  description = "The tables' Iceberg catalog (FEDGATE_SPARK_CATALOG_URI for analysts' readers in the VPC; user fedgate, catalog_password)."
  value       = local.catalog_jdbc_uri
}
