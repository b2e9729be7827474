output "region" {
  description = "fedgate region name (cluster name, Route53 set identifier)."
  value       = var.region
}

output "aws_region" {
  description = "AWS region the gateway cluster runs in (the latency record's region)."
  value       = data.aws_region.current.name
}

output "vpc_id" {
  description = "ID of the region's VPC."
  value       = aws_vpc.this.id
}

output "subnet_ids" {
  description = "Public subnets, one per availability zone."
  value       = aws_subnet.public[*].id
}

output "gateway_security_group_id" {
  description = "Security group of the gateway nodes."
  value       = aws_security_group.gateway.id
}

output "lb_security_group_id" {
  description = "Security group of the network load balancer."
  value       = aws_security_group.lb.id
}

output "autoscaling_group_name" {
  description = "Autoscaling group of the gateway nodes."
  value       = module.nodes.autoscaling_group_name
}

output "lb_dns_name" {
  description = "DNS name of the network load balancer (MQTT 1883, 8883 with a certificate; AMQP 5672 for the backend)."
  value       = aws_lb.this.dns_name
}

output "mqtt_endpoint" {
  description = "Where this region's devices connect: host and port of the load balancer."
  value       = { host = aws_lb.this.dns_name, port = local.mqtt_port, tls_port = var.certificate_arn == null && !local.node_tls ? null : local.mqtts_port }
}

output "amqp_endpoint" {
  description = "Where the backend's federation upstream for this region points: AMQPS (checked against server_name) with node_tls, else AMQP, through the load balancer."
  value = {
    host        = aws_lb.this.dns_name
    port        = local.node_tls ? local.amqps_port : local.amqp_port
    tls         = local.node_tls
    server_name = local.server_name
  }
}

output "mqtt_hostname" {
  description = "The fleet's latency-routed MQTT hostname (null without a DNS record)."
  value       = var.create_dns_record ? var.mqtt_hostname : null
}

output "route53_record_set_identifier" {
  description = "Set identifier of this region's latency record."
  value       = var.create_dns_record ? aws_route53_record.mqtt[0].set_identifier : null
}

output "route53_health_check_id" {
  description = "ID of the health check guarding this region's latency record (CLOUDWATCH_METRIC: it follows health_alarm_name)."
  value       = var.create_dns_record ? aws_route53_health_check.this[0].id : null
}

output "health_alarm_name" {
  description = "CloudWatch alarm that is in ALARM while the load balancer sees no healthy gateway node (HealthyHostCount of the MQTT target group < 1): the region's health in Route53."
  value       = var.create_dns_record ? aws_cloudwatch_metric_alarm.mqtt_healthy_nodes[0].alarm_name : null
}

output "management_url" {
  description = "The region's management API through its load balancer, open to the backend (backend_cidr_blocks) and operators only: what the backend's routers read the region's presence from (fedgate registers it in the backend's region registry). HTTPS with node_tls, its certificate for node_tls.server_name."
  value       = "${local.node_tls ? "https" : "http"}://${aws_lb.this.dns_name}:${local.management_lb_port}"
}
