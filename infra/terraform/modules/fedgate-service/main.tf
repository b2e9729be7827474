# A fedgate service on EC2: an autoscaling group of Debian 13 instances that install
# the fedgate release (a wheel in S3) through cloud-init and run one service as a
# systemd unit -- the router (several instances) or the Spark job that keeps the
# analysts' tables (one). The backend module stamps both out with it.

data "aws_region" "current" {}

# Debian names its images after the architecture (debian-13-amd64-*, debian-13-arm64-*).
data "aws_ec2_instance_type" "this" {
  count = var.ami_id == null ? 1 : 0

  instance_type = var.instance_type
}

locals {
  ami_arch = var.ami_id != null ? null : (
    contains(data.aws_ec2_instance_type.this[0].supported_architectures, "x86_64") ? "amd64" : "arm64"
  )
}

data "aws_ami" "debian" {
  count = var.ami_id == null ? 1 : 0

  most_recent = true
  owners      = var.ami_owners

  filter {
    name   = "name"
    values = [coalesce(var.ami_name_filter, "debian-13-${local.ami_arch}-*")]
  }

  filter {
    name   = "architecture"
    values = [local.ami_arch == "amd64" ? "x86_64" : "arm64"]
  }
}

locals {
  unit_name   = "fedgate-${var.service}.service"
  config_file = "/etc/fedgate/${var.service}.toml"
  env_file    = "/etc/fedgate/${var.service}.env"
  installer   = "/usr/local/sbin/fedgate-install"
  python      = "/opt/fedgate/venv/bin/python"
  # the service's own entry point, as the local federation starts it (infra/local/services.py)
  entry = { router = "router", spark = "spark.job" }[var.service]
  # each instance's own name for its process: a router's names its presence queue
  id_args = var.service == "router" ? ["--service", "router", "--id-variable", "FEDGATE_ROUTER_ROUTER_ID"] : []
  # the Spark job's jars, unpacked beside the venv (spark.toml's jars_dir = /opt/fedgate/jars)
  jars_args = var.jars_key == null ? [] : ["--jars-key", var.jars_key]

  unit = <<-EOT
    # written by the fedgate-service Terraform module
    [Unit]
    Description=fedgate ${var.service}
    Wants=network-online.target
    After=network-online.target

    [Service]
    # the secrets fedgate-install read from Secrets Manager at boot (mode 600, read by systemd)
    EnvironmentFile=${local.env_file}
    ExecStart=${local.python} -m ${local.entry} --config ${local.config_file}
    # SIGTERM: the service stops taking work, drains what it holds and exits 0. To the main
    # process only (mixed): the Spark job's JVM is its child, which it stops itself once the
    # tables are committed -- signalled together (control-group), the JVM died under a commit
    # and the job exited 1 (the cloud rehearsal). What is left after the main process: SIGKILL.
    KillMode=mixed
    KillSignal=SIGTERM
    TimeoutStopSec=120
    Restart=always
    RestartSec=5
    # no account of its own to manage; state (the job's local scratch) in /var/lib/fedgate-${var.service}
    DynamicUser=yes
    StateDirectory=fedgate-${var.service}
    WorkingDirectory=/var/lib/fedgate-${var.service}
    Environment=HOME=/var/lib/fedgate-${var.service}
    ProtectSystem=strict
    ProtectHome=yes
    PrivateTmp=yes
    NoNewPrivileges=yes
    LimitNOFILE=65536

    [Install]
    WantedBy=multi-user.target
  EOT

  user_data = join("\n", ["#cloud-config", yamlencode({
    package_update = true
    # python3-boto3: fedgate-install fetches the release and the secret before any venv
    # exists; a JRE for the Spark job (pyspark starts a JVM)
    packages = concat(
      ["ca-certificates", "python3", "python3-venv", "python3-boto3"],
      var.service == "spark" ? ["default-jre-headless"] : [],
    )
    write_files = [
      { path = local.config_file, permissions = "0644", content = var.config_toml },
      { path = "/etc/systemd/system/${local.unit_name}", permissions = "0644", content = local.unit },
      { path = local.installer, permissions = "0755", content = file("${path.module}/files/fedgate-install.py") },
    ]
    runcmd = [
      concat([local.installer, "--region", data.aws_region.current.name, "--bucket", var.release_bucket,
      "--key", var.release_key, "--secret-arn", var.secret_arn, "--env-file", local.env_file], local.id_args, local.jars_args),
      ["systemctl", "daemon-reload"],
      ["systemctl", "enable", "--now", local.unit_name],
    ]
  })])
}

# --- what the instances may read --------------------------------------------------

resource "aws_iam_role" "this" {
  name = var.name
  tags = var.tags
  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "ec2.amazonaws.com" }
      Action    = "sts:AssumeRole"
    }]
  })
}

resource "aws_iam_role_policy" "this" {
  name = "fedgate-${var.service}"
  role = aws_iam_role.this.id
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = concat(
      [
        {
          Sid      = "Release"
          Effect   = "Allow"
          Action   = ["s3:GetObject"]
          Resource = [for key in compact([var.release_key, var.jars_key]) : "arn:aws:s3:::${var.release_bucket}/${key}"]
        },
        {
          Sid      = "Secret"
          Effect   = "Allow"
          Action   = ["secretsmanager:GetSecretValue"]
          Resource = [var.secret_arn]
        },
      ],
      length(var.s3_bucket_arns) == 0 ? [] : [
        {
          Sid      = "Buckets"
          Effect   = "Allow"
          Action   = ["s3:ListBucket", "s3:GetBucketLocation"]
          Resource = var.s3_bucket_arns
        },
        {
          Sid      = "Objects"
          Effect   = "Allow"
          Action   = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
          Resource = [for arn in var.s3_bucket_arns : "${arn}/*"]
        },
      ],
    )
  })
}

resource "aws_iam_instance_profile" "this" {
  name = var.name
  role = aws_iam_role.this.name
  tags = var.tags
}

# --- the instances ----------------------------------------------------------------

resource "aws_launch_template" "this" {
  name                   = var.name
  image_id               = coalesce(var.ami_id, try(data.aws_ami.debian[0].id, null))
  instance_type          = var.instance_type
  user_data              = base64encode(local.user_data)
  vpc_security_group_ids = var.security_group_ids

  iam_instance_profile {
    arn = aws_iam_instance_profile.this.arn
  }

  # IMDSv2 only, one hop: the role's credentials stay on the instance
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = var.name })
  }
}

resource "aws_autoscaling_group" "this" {
  name                = var.name
  min_size            = var.instance_count
  max_size            = var.instance_count
  desired_capacity    = var.instance_count
  vpc_zone_identifier = var.subnet_ids
  health_check_type   = "EC2"

  launch_template {
    id      = aws_launch_template.this.id
    version = aws_launch_template.this.latest_version
  }

  dynamic "tag" {
    for_each = merge(var.tags, { Name = var.name, "fedgate:service" = var.service })
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }
}
