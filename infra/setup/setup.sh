#!/usr/bin/env bash
# fedgate setup: everything the local federation, the tests and the demo need.
#
# Idempotent by design: every step checks what is already there and does
# nothing when it is. A second run takes seconds. Nothing is downloaded later
# at service start -- the local driver only reads what this script put in
# place.
#
#   1. system packages from Debian: a Java runtime for Kafka and Spark, Maven
#      to resolve jars, openssl; RabbitMQ 4.0 from Debian 13 for every node and
#      Mosquitto 2.0 of the same release, the benchmarks' baseline
#      (rabbitmq4.sh: the system's packages on Debian 13, a Debian 13 root in
#      .cache on Debian 12 -- which runs its own epmd too, so Debian 12's
#      rabbitmq-server, Erlang and mosquitto are not needed)
#   2. the project virtualenv (.venv) with the Python dependencies
#   3. Apache Kafka's broker jars (pinned, KRaft) into .cache/jars/kafka-<v>/
#   4. Spark's Kafka source, Apache Iceberg's Spark runtime (with the SQLite
#      JDBC driver of its local catalog) and Hadoop's s3a file system with the
#      AWS SDK modules it uses, matching the installed pyspark, into
#      .cache/jars/spark-<v>/
#   5. the Spark driver's classes archived for the JVM to map at each start
#      (.cache/cds/, spark/class_archive.py)
#   (1. also installs PowerDNS, the devices' DNS server: pdns-server and
#      pdns-backend-bind, and Prometheus; their packages would start a
#      system-wide server, which policy-rc.d below keeps from starting)
#
# From nothing it takes about a minute here, most of it the Debian 13 root and the jars:
# the virtualenv (2) starts at once, beside the system packages; once those
# are in, the Debian 13 root (1) and the jars (3, 4) are fetched beside it;
# 5 needs the virtualenv and the jars, not the root.  Each background step writes its output to
# .cache/setup-logs/<step>.log; a failed one's end is printed.
#
# `setup.sh --venv-only` does step 2 alone (no root needed): `make lint` runs on it.
#
# Environment: FEDGATE_VENV (default .venv), FEDGATE_CACHE (default .cache),
# PYTHON (interpreter used to create the venv, default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${FEDGATE_VENV:-$ROOT/.venv}"
CACHE="${FEDGATE_CACHE:-$ROOT/.cache}"
PYTHON="${PYTHON:-python3}"
# the release its pom names (infra/releases.py reads the same property)
KAFKA_VERSION="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$ROOT/infra/setup/kafka-pom.xml")"
[ -n "$KAFKA_VERSION" ] || { printf '[setup] error: no <kafka.version> in infra/setup/kafka-pom.xml\n' >&2; exit 1; }
JMX_EXPORTER_VERSION="1.0.1"  # infra/local/kafka_metrics.py names it too

step() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }
SECONDS=0

# --- steps that run beside each other -----------------------------------------
LOGS="$CACHE/setup-logs"
mkdir -p "$LOGS"
declare -A bg_pid=() bg_t0=()
bg_start() { # name function [args...]: run in the background, output to its log
    local name=$1
    shift
    rm -f "$LOGS/$name.rc"
    # NAME.rc: its exit status and when it ended (this script's SECONDS)
    ( set +e; ( set -e; "$@" ); rc=$?; echo "$rc $SECONDS" >"$LOGS/$name.rc" ) >"$LOGS/$name.log" 2>&1 &
    bg_pid[$name]=$!
    bg_t0[$name]=$SECONDS
}
bg_wait() { # name...: until each has ended; their [setup] lines relayed; die on a failure
    local name rc ended failed=() waiting last_note=$SECONDS
    while :; do
        waiting=()
        for name in "$@"; do [[ -f "$LOGS/$name.rc" ]] || waiting+=("$name"); done
        ((${#waiting[@]})) || break
        if ((SECONDS - last_note >= 20)); then
            step "still working: ${waiting[*]} (${SECONDS}s so far)"
            last_note=$SECONDS
        fi
        sleep 0.5
    done
    for name in "$@"; do
        wait "${bg_pid[$name]}" 2>/dev/null || true
        grep -a '\[setup\]' "$LOGS/$name.log" || true
        read -r rc ended <"$LOGS/$name.rc"
        if [[ "$rc" != 0 ]]; then
            printf '[setup] %s failed; the end of %s:\n' "$name" "$LOGS/$name.log" >&2
            tail -n 30 "$LOGS/$name.log" >&2
            failed+=("$name")
        elif ((ended - bg_t0[$name] > 1)); then
            step "$name: done in $((ended - bg_t0[$name]))s"
        fi
        unset "bg_pid[$name]"
    done
    ((${#failed[@]} == 0)) || die "${failed[*]} failed (above)"
}
# a setup stopped (Ctrl-C, SIGTERM) or failed leaves no step running and no policy-rc.d
created_policy=0
kill_tree() { # pid: its descendants (pip, mvn, debootstrap), then itself
    local child
    for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do kill_tree "$child"; done
    kill "$1" 2>/dev/null || true
}
cleanup() {
    local p
    for p in "${bg_pid[@]}"; do kill_tree "$p"; done
    if ((created_policy)); then rm -f /usr/sbin/policy-rc.d; fi
}
trap cleanup EXIT

# --- 2. Python virtualenv (from the start: it needs nothing of the others) -----
# The stamp holds a hash of pyproject.toml: a changed dependency list
# reinstalls, an unchanged one skips pip entirely.
install_venv() {
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    # uv installs the same packages as pip from the same index, downloading them side by
    # side: 28 s from an empty cache where pip took 63 s with a warm one (pyspark's source
    # build is most of both).  pip stays the way if uv cannot be had.  Neither compiles
    # bytecode: compile_bytecode does that on every core, beside the steps after.
    if "$VENV/bin/python" -m pip install -q --disable-pip-version-check uv; then
        # pip too, current: the release (infra/cloud/release.py) builds its wheel with it
        "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --upgrade pip -e "$ROOT[dev]"
    else
        echo "[setup] uv could not be installed: installing with pip (slower)"
        "$VENV/bin/python" -m pip install -q --upgrade pip
        "$VENV/bin/python" -m pip install -q --no-compile -e "$ROOT[dev]"
    fi
    echo "$want_stamp" >"$VENV/.fedgate-stamp"
}
# A file that does not compile (a package's Python 2 test data) is skipped, as pip skips it.
# Python writes each .pyc whole or not at all: an import meanwhile compiles its own file.
compile_bytecode() {
    "$VENV/bin/python" -m compileall -q -j 0 "$VENV"/lib/python*/site-packages >/dev/null || true
}
# A first setup writes ~5 GB: uv's cache holds ~3.2 GB of it (pyspark's source and the wheel
# built from it), the virtualenv, jars and RabbitMQ root ~0.9 GB, Debian's packages the rest.
# A disk that fills half-way fails deep inside pyspark's build ("No space left on device"):
# say so up front, naming the disks, without refusing (the figure is an estimate).
warn_if_disk_short() {
    local dir avail_mb mount seen=" "
    for dir in "${UV_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}}" "$(dirname "$VENV")" "$CACHE"; do
        while [[ ! -d "$dir" ]]; do dir=$(dirname "$dir"); done
        read -r avail_mb mount < <(df -Pm "$dir" | awk 'NR==2 {print $4, $6}')
        [[ "$seen" != *" $mount "* ]] || continue
        seen+="$mount "
        if [[ -n "$avail_mb" ]] && ((avail_mb < 5000)); then
            step "warning: ${avail_mb} MB free on $mount (holding $dir); a first setup needs about 5,000 MB"
        fi
    done
}
want_stamp=$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)
venv_job=()
if [[ -f "$VENV/.fedgate-stamp" && "$(cat "$VENV/.fedgate-stamp")" == "$want_stamp" ]]; then
    step "virtualenv up to date ($VENV)"
else
    step "installing Python dependencies into $VENV (pyspark is large: half a minute or more)"
    warn_if_disk_short
    bg_start virtualenv install_venv
    venv_job=(virtualenv)
fi
if [[ "${1:-}" == "--venv-only" ]]; then
    # make lint: the virtualenv alone, no root, no system packages, no broker root or jars
    ((${#venv_job[@]} == 0)) || { bg_wait virtualenv; compile_bytecode; }
    step "virtualenv ready in ${SECONDS}s"
    exit 0
fi

# --- 1. system packages -----------------------------------------------------
need_pkgs=()
# RabbitMQ 4.0 and the baseline broker `make bench` measures fedgate against
# (Mosquitto 2.0): on Debian 13 the system's own packages (on Debian 12,
# rabbitmq4.sh below builds a Debian 13 root holding both instead: Debian 12's
# rabbitmq-server 3.10 and mosquitto 2.0.11 are not used)
if [[ "$(cut -d. -f1 /etc/debian_version 2>/dev/null | tr -dc '0-9')" -ge 13 ]]; then
    [[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ]] || need_pkgs+=(rabbitmq-server)
    [[ -x /usr/sbin/mosquitto ]] || need_pkgs+=(mosquitto)
fi
command -v java >/dev/null 2>&1 || need_pkgs+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || need_pkgs+=(maven)
command -v openssl >/dev/null 2>&1 || need_pkgs+=(openssl)  # the local federation's CA (TLS)
# the DNS server devices resolve mqtt.<domain> at (infra/dns): PowerDNS Authoritative
# with LUA records, the bind backend reading the zone file fedgate writes
[[ -x /usr/sbin/pdns_server ]] || need_pkgs+=(pdns-server)
compgen -G "/usr/lib/*/pdns/libbindbackend.so" >/dev/null || need_pkgs+=(pdns-backend-bind)
# the federation's own Prometheus (infra/local/prometheus_node.py) and promtool, which
# checks its rules in make test
[[ -x /usr/bin/prometheus ]] || need_pkgs+=(prometheus)
# the fleet console's test looks at it in a headless browser (tests/integration/test_console.py)
[[ -x /usr/bin/chromium ]] || need_pkgs+=(chromium)
# the tables' shared Iceberg catalog as the cloud keeps it (PostgreSQL, RDS there): the tests
# start a server of their own (infra/local/postgres.py)
compgen -G "/usr/lib/postgresql/*/bin/postgres" >/dev/null || need_pkgs+=(postgresql)
if ((${#need_pkgs[@]})); then
    step "installing Debian packages: ${need_pkgs[*]}"
    [[ $(id -u) -eq 0 ]] || die "installing ${need_pkgs[*]} needs root (run as root or install them yourself)"
    # The mosquitto and rabbitmq-server packages start a system-wide broker
    # when they are installed. fedgate runs its own brokers, so keep the system one from
    # starting (policy-rc.d is Debian's switch for that) -- and only remove
    # the switch again if we were the ones who put it there.
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        created_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
    if ((created_policy)); then rm -f /usr/sbin/policy-rc.d; fi
    created_policy=0
else
    step "Debian packages present (java, maven, openssl, pdns-server, postgresql, prometheus, chromium)"
fi
java_major=$(java -XshowSettings:properties -version 2>&1 | awk -F'= ' '/java.specification.version/{print $2}')
[[ "${java_major%%.*}" -ge 17 ]] || die "Kafka 4 and Spark 4 need Java 17 or newer; found $java_major"

# RabbitMQ 4.0 from Debian 13: the system's package there, a cached Debian 13
# root on Debian 12 (infra/setup/rabbitmq4.sh says why); beside the jars below
bg_start rabbitmq bash "$ROOT/infra/setup/rabbitmq4.sh" "$CACHE"

# --- 3 & 4. jars from Maven Central ---
# pyspark is pinned to a release whose Kafka source resolves from Maven Central
# here (4.0.0: the later 4.x Kafka source jars were not all resolvable).
# -U: retry artifacts an earlier failed run marked missing.---------------------------------------
# A folder is complete when its .complete stamp holds the hash of the pom it was
# resolved from: editing a pom fetches again on the next `make setup`.
fetch_jars() { # name pom dest [extra mvn args...]
    local name=$1 pom=$2 dest=$3 stamp
    shift 3
    stamp=$(cat "$pom" <(echo "$@") | sha256sum | cut -c1-16)
    if [[ "$(cat "$dest/.complete" 2>/dev/null)" == "$stamp" ]]; then
        step "$name jars present ($dest)"
        return
    fi
    step "downloading $name jars with Maven into $dest"
    rm -rf "$dest.partial"
    mkdir -p "$dest.partial"
    mvn -B -q -U -Dstyle.color=never -f "$pom" "$@" dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$dest.partial" \
        || die "Maven could not resolve the $name jars (see the output above)"
    echo "$stamp" >"$dest.partial/.complete"
    rm -rf "$dest"
    mv "$dest.partial" "$dest"
}
# the release pyproject.toml pins (the venv may still be on its way)
spark_version=$(sed -nE 's/.*"pyspark(\[[a-z,]+\])?==([0-9.]+)".*/\2/p' "$ROOT/pyproject.toml" | head -n1)
[[ -n "$spark_version" ]] || die "pyproject.toml pins no pyspark release (pyspark==X.Y.Z)"
spark_jars="$CACHE/jars/spark-$spark_version"
fetch_all_jars() {
    fetch_jars "Kafka $KAFKA_VERSION" "$ROOT/infra/setup/kafka-pom.xml" \
        "$CACHE/jars/kafka-$KAFKA_VERSION" -Dkafka.version="$KAFKA_VERSION"
    fetch_jars "Spark $spark_version: Kafka source, Iceberg, s3a" "$ROOT/infra/setup/spark-pom.xml" \
        "$spark_jars" -Dspark.version="$spark_version"
    # each Kafka broker's metrics for the federation's Prometheus (infra/local/kafka_metrics.py)
    fetch_jars "Prometheus JMX exporter" "$ROOT/infra/setup/jmx-exporter-pom.xml" \
        "$CACHE/jars/jmx-exporter-$JMX_EXPORTER_VERSION" -Djmx.exporter.version="$JMX_EXPORTER_VERSION"
}
bg_start jars fetch_all_jars
bg_wait "${venv_job[@]}" jars
bytecode_job=()
if ((${#venv_job[@]})); then # off the path to the class archive, which needs only the packages
    bg_start bytecode compile_bytecode
    bytecode_job=(bytecode)
fi

installed=$("$VENV/bin/python" -c 'import pyspark; print(pyspark.__version__)')
[[ "$installed" == "$spark_version" ]] || die "the venv holds pyspark $installed, pyproject.toml pins $spark_version"
# Keep only what pyspark lacks: a second scala-library, hadoop client or netty on
# the classpath would shadow pyspark's own and break at run time.  (Every run: a
# setup stopped between the download and this leaves nothing behind.)
pyspark_jars=$("$VENV/bin/python" -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "jars"))')
for jar in "$spark_jars"/*.jar; do
    artifact=$(basename "$jar" | sed -E 's/-[0-9][^-]*(-[A-Za-z0-9.]+)?\.jar$//')
    if compgen -G "$pyspark_jars/$artifact-[0-9]*.jar" >/dev/null; then rm -f "$jar"; fi
done

# --- 5. the Spark driver's class archive (spark/class_archive.py): a driver starts in
# ~6 CPU s instead of ~10.  Written once per pyspark release (~25 s); none is no error.
(cd "$ROOT" && "$VENV/bin/python" -m spark.class_archive)

bg_wait rabbitmq "${bytecode_job[@]}"

step "done in ${SECONDS}s"
