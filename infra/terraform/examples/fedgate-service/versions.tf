terraform {
  required_version = ">= 1.9.0"

  # State in S3, locked, instead of terraform.tfstate here (the default): uncomment,
  # copy ../s3.tfbackend.example to s3.tfbackend with your bucket, then
  #   terraform init -backend-config=s3.tfbackend -backend-config="key=fedgate/rabbitmq-nodes/terraform.tfstate"
  # (add -migrate-state to move a local state there).
  # backend "s3" {}

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40, < 6.0"
    }
  }
}
