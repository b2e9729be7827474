output "zone_id" {
  description = "Hosted zone holding the latency record."
  value       = coalesce(var.zone_id, try(aws_route53_zone.this[0].zone_id, null))
}

output "vpc_id" {
  description = "ID of the region's VPC."
  value       = module.gateway_region.vpc_id
}

output "autoscaling_group_name" {
  description = "Autoscaling group of the gateway nodes."
  value       = module.gateway_region.autoscaling_group_name
}

output "lb_dns_name" {
  description = "DNS name of the network load balancer."
  value       = module.gateway_region.lb_dns_name
}

output "mqtt_hostname" {
  description = "The fleet's latency-routed MQTT hostname."
  value       = module.gateway_region.mqtt_hostname
}

output "route53_health_check_id" {
  description = "Health check guarding the region's latency record."
  value       = module.gateway_region.route53_health_check_id
}

output "health_alarm_name" {
  description = "CloudWatch alarm the health check follows: in ALARM while no gateway node passes the load balancer's check."
  value       = module.gateway_region.health_alarm_name
}

output "amqp_endpoint" {
  description = "Where the backend's federation link for this region connects."
  value       = module.gateway_region.amqp_endpoint
}

output "management_url" {
  description = "The region's management API through its load balancer (the backend's routers, operators)."
  value       = module.gateway_region.management_url
}
