# A RabbitMQ cluster on EC2: an autoscaling group of Debian nodes that install
# Debian's rabbitmq-server through cloud-init, take fedgate's rendered config,
# and find each other through AWS peer discovery (by autoscaling group).
# The gateway-region and backend modules both stamp their nodes out with it.

data "aws_region" "current" {}

data "aws_ami" "debian" {
  count = var.ami_id == null ? 1 : 0

  most_recent = true
  owners      = ["136693071363"] # Debian's official AMIs

  filter {
    name   = "name"
    values = ["debian-12-amd64-*"]
  }
}

locals {
  has_definitions = var.definitions != ""

  rabbitmq_conf = join("\n", [
    var.rabbitmq_conf,
    "# --- cloud: rendered by the rabbitmq-nodes Terraform module ---",
    "cluster_formation.peer_discovery_backend = aws",
    "cluster_formation.aws.region = ${data.aws_region.current.name}",
    "cluster_formation.aws.use_autoscaling_group = true",
    "cluster_formation.aws.use_private_ip = true",
    local.has_definitions ? "load_definitions = /etc/rabbitmq/definitions.json" : "",
    "",
  ])
  enabled_plugins = replace(trimspace(var.enabled_plugins), "].", ",rabbitmq_peer_discovery_aws].")

  user_data = join("\n", ["#cloud-config", yamlencode({
    package_update = true
    packages       = ["rabbitmq-server"]
    write_files = concat(
      [
        { path = "/etc/rabbitmq/rabbitmq.conf", permissions = "0640", content = local.rabbitmq_conf },
        { path = "/etc/rabbitmq/enabled_plugins", permissions = "0644", content = "${local.enabled_plugins}\n" },
        { path = "/etc/fedgate/erlang.cookie", permissions = "0400", content = var.erlang_cookie },
      ],
      var.max_fds == null ? [] : [
        {
          path        = "/etc/systemd/system/rabbitmq-server.service.d/fedgate.conf"
          permissions = "0644"
          content     = "[Service]\nLimitNOFILE=${var.max_fds}\n"
        },
      ],
      local.has_definitions ? [
        { path = "/etc/rabbitmq/definitions.json", permissions = "0640", content = var.definitions },
      ] : [],
      # chowned to rabbitmq with the rest of /etc/rabbitmq below; the key readable by it only
      var.tls_files == null ? [] : [
        { path = "/etc/rabbitmq/tls/ca.pem", permissions = "0644", content = var.tls_files.ca_pem },
        { path = "/etc/rabbitmq/tls/cert.pem", permissions = "0644", content = var.tls_files.cert_pem },
        { path = "/etc/rabbitmq/tls/key.pem", permissions = "0400", content = var.tls_files.key_pem },
      ],
    )
    # The package starts the broker with its defaults; restart it with the
    # cluster's cookie and fedgate's config.
    runcmd = [
      ["systemctl", "stop", "rabbitmq-server"],
      ["install", "-o", "rabbitmq", "-g", "rabbitmq", "-m", "0400", "/etc/fedgate/erlang.cookie", "/var/lib/rabbitmq/.erlang.cookie"],
      ["chown", "-R", "rabbitmq:rabbitmq", "/etc/rabbitmq"],
      ["rm", "-rf", "/var/lib/rabbitmq/mnesia"],
      ["systemctl", "daemon-reload"],
      ["systemctl", "start", "rabbitmq-server"],
    ]
  })])
}

# Peer discovery: a node finds the others through its autoscaling group.
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

resource "aws_iam_role_policy" "peer_discovery" {
  name = "rabbitmq-peer-discovery"
  role = aws_iam_role.this.id
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect   = "Allow"
      Action   = ["autoscaling:DescribeAutoScalingInstances", "ec2:DescribeInstances"]
      Resource = "*"
    }]
  })
}

resource "aws_iam_instance_profile" "this" {
  name = var.name
  role = aws_iam_role.this.name
  tags = var.tags
}

resource "aws_launch_template" "this" {
  name                   = var.name
  image_id               = coalesce(var.ami_id, try(data.aws_ami.debian[0].id, null))
  instance_type          = var.instance_type
  user_data              = base64encode(local.user_data)
  vpc_security_group_ids = var.security_group_ids
  # No tags on the template itself: the instances get theirs from
  # tag_specifications and the autoscaling group (moto echoes template tags
  # back as an extra tag_specifications block, which would re-plan forever).

  iam_instance_profile {
    arn = aws_iam_instance_profile.this.arn
  }

  metadata_options {
    http_tokens = "required"
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = var.name })
  }
}

resource "aws_autoscaling_group" "this" {
  name                = var.name
  min_size            = var.node_count
  max_size            = var.node_count
  desired_capacity    = var.node_count
  vpc_zone_identifier = var.subnet_ids
  target_group_arns   = var.target_group_arns
  health_check_type   = "ELB"

  launch_template {
    id      = aws_launch_template.this.id
    version = aws_launch_template.this.latest_version
  }

  dynamic "tag" {
    for_each = merge(var.tags, { Name = var.name })
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }
}
