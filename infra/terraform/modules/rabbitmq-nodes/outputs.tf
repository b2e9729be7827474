output "autoscaling_group_name" {
  description = "Name of the nodes' autoscaling group (peer discovery and scaling go by it)."
  value       = aws_autoscaling_group.this.name
}

output "launch_template_id" {
  description = "ID of the nodes' launch template."
  value       = aws_launch_template.this.id
}

output "iam_role_name" {
  description = "IAM role of the nodes (peer discovery); attach more policies to it if the nodes need them."
  value       = aws_iam_role.this.name
}
