#!/usr/bin/env bash
# RabbitMQ 4.0 for every fedgate node, from Debian 13's packages.
#
# On a Debian 13 (trixie) host the system's own rabbitmq-server is 4.0:
# it is installed like any package.  On Debian 12 (bookworm), whose
# rabbitmq-server is 3.10, installing trixie's package into the system would
# replace libc6 and ~50 other packages -- a mixed-release system.  Instead a
# minimal Debian 13 root holding rabbitmq-server (and mosquitto, the
# benchmark's baseline of the same release) is built once with debootstrap
# into the cache, and infra/local/broker.py runs each node (and epmd, and the
# benchmark's Mosquitto) from it in a private mount namespace with chroot
# (unshare, from util-linux): the host's network and the node's own state
# folder are shared.
#
# Idempotent: a complete root carries a stamp and is never rebuilt (unless a
# program it must hold is missing); a failed build leaves only a .partial
# folder, removed by the next run.
#
# Usage: rabbitmq4.sh CACHE_DIR      (called by setup.sh)
set -euo pipefail

CACHE="$1"
DEST="$CACHE/rabbitmq-4.0"
SUITE=trixie
PACKAGES=rabbitmq-server,mosquitto
#: what the root must hold, one program of each package
PROGRAMS=(usr/lib/rabbitmq/bin/rabbitmq-server usr/sbin/mosquitto)

step() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

debian_major() { cut -d. -f1 /etc/debian_version 2>/dev/null | tr -dc '0-9'; }

if [[ "$(debian_major)" -ge 13 ]]; then
    # the system's packages are the release fedgate runs: nothing to build
    step "Debian $(debian_major): RabbitMQ 4 comes from the system's rabbitmq-server"
    exit 0
fi

holds_programs() { # root
    local p
    for p in "${PROGRAMS[@]}"; do [[ -x "$1/$p" ]] || return 1; done
}

if [[ -f "$DEST/.complete" ]]; then
    if holds_programs "$DEST/root"; then
        step "RabbitMQ $(cat "$DEST/.complete") root present ($DEST/root)"
        exit 0
    fi
    step "the Debian 13 root in $DEST lacks one of ${PROGRAMS[*]}: building it again"
fi

[[ $(id -u) -eq 0 ]] || die "building the Debian 13 root for RabbitMQ 4 needs root (debootstrap)"
need=()
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if ((${#need[@]})); then
    step "installing Debian packages: ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# The archive this machine's apt already uses (deb822 sources first, then the
# one-line format): debootstrap fetches trixie from the same place.
mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
if [[ -z "$mirror" ]]; then
    mirror=$(awk '$1=="deb" && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
fi
[[ -n "$mirror" ]] || die "no Debian archive found in apt's sources to build the Debian 13 root from"

step "building a Debian 13 root with $PACKAGES into $DEST (once; ~1 min, ~370 MB)"
rm -rf "$DEST.partial"
mkdir -p "$DEST.partial"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$DEST.partial/root" "$mirror" \
    >"$DEST.partial/debootstrap.log" 2>&1 \
    || die "debootstrap failed; its log: $DEST.partial/debootstrap.log"
version=$(ls "$DEST.partial/root/usr/lib/rabbitmq/lib" | sed -n 's/^rabbitmq_server-//p' | head -1)
[[ "$version" == 4.* ]] || die "the Debian 13 root holds RabbitMQ '${version:-none}', not 4.x"
holds_programs "$DEST.partial/root" || die "the Debian 13 root lacks one of ${PROGRAMS[*]}"
# nothing in the root runs as a service: its package scripts' leftovers go
rm -rf "$DEST.partial/root/var/lib/rabbitmq/mnesia" "$DEST.partial/root/var/cache/apt/archives"/*.deb
echo "$version" >"$DEST.partial/.complete"
rm -rf "$DEST"
mv "$DEST.partial" "$DEST"
step "RabbitMQ $version ready in $DEST/root"
