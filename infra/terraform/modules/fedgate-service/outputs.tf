output "autoscaling_group_name" {
  description = "Name of the service's autoscaling group."
  value       = aws_autoscaling_group.this.name
}

output "iam_role_name" {
  description = "IAM role of the instances; attach more policies to it if the service needs them."
  value       = aws_iam_role.this.name
}

output "unit" {
  description = "The systemd unit the instances run the service as (journalctl -u <unit> on an instance)."
  value       = local.unit_name
}
