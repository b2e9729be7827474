output "autoscaling_group_name" {
  description = "The routers' autoscaling group."
  value       = module.routers.autoscaling_group_name
}
