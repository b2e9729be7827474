terraform {
  # 1.9: templatestring (callers pass the node templates in as text) and
  # validations that read other variables (node_count and allow_single_node).
  required_version = ">= 1.9.0"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # 5.x: the machines here carry a filesystem mirror of 5.100.0.
      version = ">= 5.40, < 6.0"
    }
  }
}
