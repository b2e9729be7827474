terraform {
  # 1.9: validations that read other variables (instance_count and service).
  required_version = ">= 1.9.0"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # 5.x: the machines here carry a filesystem mirror of 5.100.0.
      version = ">= 5.40, < 6.0"
    }
  }
}
