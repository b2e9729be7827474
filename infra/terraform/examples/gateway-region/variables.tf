variable "aws_region" {
  description = "AWS region of the gateway cluster (also its fedgate region name)."
  type        = string
  default     = "eu-west-1"
}

variable "domain" {
  description = "The fleet's DNS domain; devices connect to mqtt.<domain>."
  type        = string
  default     = "fleet.example.com"
}

variable "zone_id" {
  description = "Existing Route53 hosted zone of the domain. Null: this example creates one."
  type        = string
  default     = null
}

variable "admin_cidr_blocks" {
  description = "Operators allowed on the management port."
  type        = list(string)
  default     = ["203.0.113.0/24"]
}

variable "backend_cidr_blocks" {
  description = "The backend's egress addresses (backend module output egress_cidr_blocks)."
  type        = list(string)
  default     = ["198.51.100.10/32"]
}

variable "ami_id" {
  description = "AMI of the gateway nodes (Debian 13). Null: the newest official Debian 13 AMI."
  type        = string
  default     = null
}

variable "admin_password" {
  description = "Password of fedgate-admin on the gateway nodes."
  type        = string
  sensitive   = true
}

variable "erlang_cookie" {
  description = "Erlang cookie of the gateway cluster."
  type        = string
  sensitive   = true
}

variable "node_tls" {
  description = "TLS on the gateway nodes (fedgate's CA): AMQPS for the backend, MQTT over TLS passed through. Null: plain."
  type = object({
    ca_pem      = string
    cert_pem    = string
    server_name = string
  })
  default = null
}

variable "node_tls_key_pem" {
  description = "Private key of node_tls's certificate."
  type        = string
  default     = null
  sensitive   = true
}
