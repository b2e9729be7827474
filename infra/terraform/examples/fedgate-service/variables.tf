variable "aws_region" {
  description = "AWS region of the routers."
  type        = string
  default     = "eu-central-1"
}

variable "release_bucket_name" {
  description = "Name of the bucket the release is uploaded to (globally unique)."
  type        = string
}

variable "release_wheel" {
  description = "Path of the fedgate wheel `make release` built (build/release/fedgate-<version>-py3-none-any.whl)."
  type        = string
}

variable "kafka_bootstrap" {
  description = "Kafka's SASL/SCRAM bootstrap servers (MSK: bootstrap_brokers_sasl_scram)."
  type        = string
}

variable "router_amqp_url" {
  description = "AMQP URL of the backend with the router's user and password."
  type        = string
  sensitive   = true
}

variable "kafka_sasl_password" {
  description = "Password of the router's SCRAM user."
  type        = string
  sensitive   = true
}
