variable "aws_region" {
  description = "AWS region of the cluster."
  type        = string
  default     = "eu-central-1"
}

variable "admin_password" {
  description = "Password of fedgate-admin on the nodes."
  type        = string
  sensitive   = true
}

variable "erlang_cookie" {
  description = "Shared Erlang cookie of the cluster."
  type        = string
  sensitive   = true
}
