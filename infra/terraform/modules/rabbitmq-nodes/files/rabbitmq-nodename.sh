#!/bin/sh
# Names the RabbitMQ node after the instance's private IPv4 address, before the broker starts.
#
# AWS peer discovery with cluster_formation.aws.use_private_ip lists the peers as
# rabbit@<private IPv4>; a node joins them only if it runs under such a name itself, and
# an IP address is a valid host part of a node name only with long names. Without both
# lines every node boots a cluster of its own.
#
# The address comes from the instance metadata service, IMDSv2 (the launch template
# refuses v1): a session token first, then the address with that token.
#
# Usage: rabbitmq-nodename [rabbitmq-env.conf]; FEDGATE_IMDS_URL points it elsewhere (tests).
set -eu

env_file=${1:-/etc/rabbitmq/rabbitmq-env.conf}
imds_url=${FEDGATE_IMDS_URL:-http://169.254.169.254}
# The metadata service may not answer in the first seconds of a boot: retry, then fail loudly.
imds() {
  curl --fail --silent --show-error --max-time 5 --retry 10 --retry-delay 1 --retry-connrefused "$@"
}

token=$(imds -X PUT -H "X-aws-ec2-metadata-token-ttl-seconds: 300" "$imds_url/latest/api/token")
ip=$(imds -H "X-aws-ec2-metadata-token: $token" "$imds_url/latest/meta-data/local-ipv4")

if ! printf '%s\n' "$ip" | grep -Eqx '([0-9]{1,3}\.){3}[0-9]{1,3}'; then
  echo "fedgate: the metadata service's local-ipv4 is '$ip', not an IPv4 address; node not named" >&2
  exit 1
fi

# Keep every other line of the file (emulator flags, plugins path); replace earlier names.
tmp="$env_file.fedgate-tmp"
{
  if [ -f "$env_file" ]; then grep -v -e '^NODENAME=' -e '^USE_LONGNAME=' "$env_file" || true; fi
  echo "NODENAME=rabbit@$ip"
  echo "USE_LONGNAME=true"
} >"$tmp"
chmod 0644 "$tmp"
mv "$tmp" "$env_file"
echo "fedgate: RabbitMQ node name rabbit@$ip"
