variable "name" {
  description = "Name of the IAM role, instance profile, launch template and autoscaling group, and the Name tag of the instances."
  type        = string
}

variable "tags" {
  description = "Tags on every resource and every instance."
  type        = map(string)
  default     = {}
}

variable "service" {
  description = "Which fedgate service the instances run: router (python -m router) or spark (python -m spark.job, the streaming job that keeps the analysts' tables)."
  type        = string

  validation {
    condition     = contains(["router", "spark"], var.service)
    error_message = "service: router or spark."
  }
}

variable "instance_count" {
  description = "Instances in the autoscaling group, one service process each. Routers: at least 2 (they share the uplink and one leads the downlink; the others take over). The Spark job: exactly 1 (one streaming query writes the tables; the group replaces a failed instance, which resumes from the checkpoint on S3)."
  type        = number
  default     = 2

  validation {
    condition     = var.service == "spark" ? var.instance_count == 1 : var.instance_count >= 2
    error_message = "instance_count: 1 for the Spark job (one writer of the tables), at least 2 for routers (no single point of failure)."
  }
}

variable "instance_type" {
  description = "EC2 instance type (the Spark job wants memory: an m6i.large or larger)."
  type        = string
  default     = "t3.medium"
}

variable "subnet_ids" {
  description = "Subnets of the instances (private: they reach the backend, Kafka and S3 inside the VPC, PyPI through the NAT gateway)."
  type        = list(string)
}

variable "security_group_ids" {
  description = "Security groups of the instances."
  type        = list(string)
}

variable "release_bucket" {
  description = "S3 bucket holding the fedgate release (the wheel `make release` builds)."
  type        = string
}

variable "release_key" {
  description = "Key of the release wheel in release_bucket. A new key (a new release) makes a new launch template version: replace the instances to roll it out."
  type        = string
}

variable "jars_key" {
  description = "Key in release_bucket of the Spark job's jars (`make release`: fedgate-spark-jars-<version>.tar.gz: the Kafka source, Iceberg, s3a, the catalog's JDBC drivers), unpacked into /opt/fedgate/jars. Required for service = spark."
  type        = string
  default     = null

  validation {
    condition     = var.service != "spark" || var.jars_key != null
    error_message = "jars_key: the Spark job needs its jars (make release builds them)."
  }
}

variable "config_toml" {
  description = "The service's config file (/etc/fedgate/<service>.toml) as the caller renders it; no secrets (they come from secret_arn)."
  type        = string
}

variable "secret_arn" {
  description = "Secrets Manager secret whose value is a JSON object of environment variables for the service (FEDGATE_ROUTER_AMQP_URL, FEDGATE_ROUTER_KAFKA_SASL_PASSWORD, ...): read at boot into /etc/fedgate/<service>.env (mode 600), never written to the launch template."
  type        = string
}

variable "s3_bucket_arns" {
  description = "Buckets the service reads and writes (the Spark job: the analytics bucket, its tables and checkpoints)."
  type        = list(string)
  default     = []
}

variable "ami_id" {
  description = "AMI of the instances; Debian 13 (trixie). Null: the newest AMI of ami_owners named ami_name_filter, for the instance type's architecture."
  type        = string
  default     = null
}

variable "ami_owners" {
  description = "Accounts the AMI lookup takes images from (when ami_id is null): Debian's official account."
  type        = list(string)
  default     = ["136693071363"]
}

variable "ami_name_filter" {
  description = "Name filter of the AMI lookup; null: debian-13-<arch>-* for the instance type's architecture."
  type        = string
  default     = null
}
