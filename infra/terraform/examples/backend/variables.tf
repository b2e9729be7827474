variable "aws_region" {
  description = "AWS region of the backend."
  type        = string
  default     = "eu-central-1"
}

variable "analytics_bucket_name" {
  description = "Name of the analytics bucket (globally unique)."
  type        = string
}

variable "admin_cidr_blocks" {
  description = "Operators (and the machine running `make gateway`) allowed on the management API."
  type        = list(string)
  default     = ["203.0.113.0/24"]
}

variable "admin_password" {
  description = "Password of fedgate-admin on the backend nodes."
  type        = string
  sensitive   = true
}

variable "erlang_cookie" {
  description = "Erlang cookie of the backend cluster."
  type        = string
  sensitive   = true
}

variable "node_tls" {
  description = "TLS on the backend nodes, from `fedgate backend-tls`. Null: plain AMQP."
  type = object({
    ca_pem      = string
    cert_pem    = string
    server_name = string
  })
  default = null
}

variable "node_tls_key_pem" {
  description = "Private key of node_tls's certificate, from `fedgate backend-tls`."
  type        = string
  default     = null
  sensitive   = true
}

variable "fedgate_release_wheel" {
  description = "The fedgate wheel `make release` built (build/release/fedgate-<version>-py3-none-any.whl): the module deploys the routers from it. Null: no routers."
  type        = string
  default     = null
}

variable "fedgate_spark_jars" {
  description = "The Spark job's jars `make release` built (build/release/fedgate-spark-jars-<version>.tar.gz): the module deploys the Spark job with them. Null: no Spark job."
  type        = string
  default     = null
}

variable "catalog_password" {
  description = "Password of the tables' catalog database (RDS PostgreSQL), from `fedgate backend-tls` (backend-secrets.auto.tfvars.json)."
  type        = string
  default     = null
  sensitive   = true
}

variable "router_password" {
  description = "Password of the routers' backend user, from `fedgate backend-tls` (backend-secrets.auto.tfvars.json)."
  type        = string
  default     = null
  sensitive   = true
}

variable "kafka_sasl_password" {
  description = "Password of the Kafka SCRAM user fedgate, from `fedgate backend-tls` (backend-secrets.auto.tfvars.json)."
  type        = string
  default     = null
  sensitive   = true
}

variable "kafka_bootstrap" {
  description = "Bootstrap servers of a Kafka of your own (SASL/SCRAM over TLS, user fedgate, password kafka_sasl_password). Null: the module creates MSK."
  type        = string
  default     = null
}
