output "autoscaling_group_name" {
  description = "The cluster's autoscaling group."
  value       = module.nodes.autoscaling_group_name
}
