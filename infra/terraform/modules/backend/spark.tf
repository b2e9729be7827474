# The Spark job that keeps the analysts' tables, deployed from the fedgate release when
# fedgate_release carries its jars (jars_key): one instance (one writer of the tables; the
# group replaces a failed one, which resumes from its checkpoint in the analytics bucket).
# The tables' data and checkpoints are in the analytics bucket (s3a), their names in an
# Iceberg JDBC catalog on RDS PostgreSQL, which every reader (Spark SQL, pyiceberg, DuckDB)
# reaches with the catalog's login.

locals {
  deploy_spark = local.deploy_routers && try(var.fedgate_release.jars_key, null) != null

  # spark/settings.py; the passwords come from the environment (the secret below)
  spark_toml = join("\n", [
    "# rendered by fedgate's backend Terraform module; passwords come from the environment",
    "kafka_bootstrap = ${jsonencode(local.router_kafka_bootstrap)}",
    "kafka_security_protocol = \"SASL_SSL\"",
    "kafka_sasl_mechanism = \"SCRAM-SHA-512\"",
    "kafka_sasl_username = ${jsonencode(local.kafka_user)}",
    "topics = ${jsonencode(var.spark_topics)}",
    "warehouse = ${jsonencode("s3a://${aws_s3_bucket.analytics.bucket}/warehouse")}",
    "s3_region = ${jsonencode(data.aws_region.current.name)}",
    "catalog_uri = ${jsonencode(coalesce(local.catalog_jdbc_uri, "-"))}",
    "catalog_user = ${jsonencode(local.catalog_user)}",
    "jars_dir = \"/opt/fedgate/jars\"",
    "master = \"local[*]\"",
    var.spark_config_extra,
    "",
  ])
  catalog_user     = "fedgate"
  catalog_database = "fedgate"
  # the job's catalog_uri and the output analysts' readers take
  catalog_jdbc_uri = local.deploy_spark ? "jdbc:postgresql://${aws_db_instance.catalog[0].address}:${aws_db_instance.catalog[0].port}/${local.catalog_database}" : null
}

data "aws_region" "current" {}

resource "aws_security_group" "spark" {
  count = local.deploy_spark ? 1 : 0

  lifecycle {
    precondition {
      condition     = var.catalog_password != null
      error_message = "catalog_password: required to deploy the Spark job (fedgate backend-tls writes it to backend-secrets.auto.tfvars.json)."
    }
  }

  name        = "${local.name}-spark"
  description = "fedgate Spark job: out to Kafka, the catalog database, S3 and PyPI"
  vpc_id      = aws_vpc.this.id
  tags        = merge(local.tags, { Name = "${local.name}-spark" })

  egress {
    description = "Kafka, the catalog database, S3, Secrets Manager, PyPI (through the NAT gateway)"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

# The Iceberg catalog: a PostgreSQL database the job and analysts' readers reach from the VPC.
resource "aws_security_group" "catalog" {
  count = local.deploy_spark ? 1 : 0

  name        = "${local.name}-catalog"
  description = "fedgate tables catalog: PostgreSQL from the Spark job and the VPC"
  vpc_id      = aws_vpc.this.id
  tags        = merge(local.tags, { Name = "${local.name}-catalog" })

  ingress {
    description     = "PostgreSQL from the Spark job"
    from_port       = 5432
    to_port         = 5432
    protocol        = "tcp"
    security_groups = [aws_security_group.spark[0].id]
  }

  ingress {
    description = "PostgreSQL from the VPC (analysts readers on a bastion or a notebook)"
    from_port   = 5432
    to_port     = 5432
    protocol    = "tcp"
    cidr_blocks = [var.vpc_cidr]
  }
}

resource "aws_db_subnet_group" "catalog" {
  count = local.deploy_spark ? 1 : 0

  name       = "${local.name}-catalog"
  subnet_ids = aws_subnet.private[*].id
  tags       = local.tags
}

resource "aws_db_instance" "catalog" {
  count = local.deploy_spark ? 1 : 0

  identifier                = "${local.name}-catalog"
  engine                    = "postgres"
  engine_version            = var.catalog_engine_version
  instance_class            = var.catalog_instance_class
  allocated_storage         = 20
  storage_encrypted         = true
  db_name                   = local.catalog_database
  username                  = local.catalog_user
  password                  = var.catalog_password
  db_subnet_group_name      = aws_db_subnet_group.catalog[0].name
  vpc_security_group_ids    = [aws_security_group.catalog[0].id]
  publicly_accessible       = false
  multi_az                  = var.catalog_multi_az
  backup_retention_period   = 7
  deletion_protection       = var.catalog_deletion_protection
  skip_final_snapshot       = !var.catalog_deletion_protection
  final_snapshot_identifier = var.catalog_deletion_protection ? "${local.name}-catalog-final" : null
  tags                      = local.tags
}

resource "aws_secretsmanager_secret" "spark" {
  count = local.deploy_spark ? 1 : 0

  name = "${local.name}-spark"
  tags = local.tags
}

resource "aws_secretsmanager_secret_version" "spark" {
  count = local.deploy_spark ? 1 : 0

  secret_id = aws_secretsmanager_secret.spark[0].id
  secret_string = jsonencode({
    FEDGATE_SPARK_KAFKA_SASL_PASSWORD = coalesce(var.kafka_sasl_password, "-")
    FEDGATE_SPARK_CATALOG_PASSWORD    = coalesce(var.catalog_password, "-")
  })
}

module "spark" {
  source = "../fedgate-service"
  count  = local.deploy_spark ? 1 : 0

  name               = "${local.name}-spark"
  tags               = local.tags
  service            = "spark"
  instance_count     = 1
  instance_type      = var.spark_instance_type
  subnet_ids         = aws_subnet.private[*].id
  security_group_ids = [aws_security_group.spark[0].id]
  release_bucket     = var.fedgate_release.bucket
  release_key        = var.fedgate_release.key
  jars_key           = var.fedgate_release.jars_key
  config_toml        = local.spark_toml
  secret_arn         = aws_secretsmanager_secret_version.spark[0].arn
  s3_bucket_arns     = [aws_s3_bucket.analytics.arn]
  ami_id             = var.ami_id
  ami_owners         = var.ami_owners
  ami_name_filter    = var.ami_name_filter
}
