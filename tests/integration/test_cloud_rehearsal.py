"""`make cloud-rehearsal`: the backend's and a gateway region's RabbitMQ nodes, booted from the
cloud-init Terraform renders for EC2 (the backend example applied against moto, the region's
planned), on three network namespaces of this machine; the backend's routers on two more.

What a user checks: the nodes name themselves after their private address from the metadata
service (IMDSv2), form one cluster of three, hold a quorum queue on every node, and keep
every confirmed message when one instance dies; the gateways (with their own authentication
plugin, compiled on each node) still answer MQTT on the two nodes left; the routers install
the release from S3 with their secret, reach the nodes through the internal load balancer's
name and Kafka over SASL_SSL, and carry every reading into Kafka when one of them dies; the
Spark job installs with its jars and makes each reading one row of its tables, named in its
catalog database (where RDS would be) and stored in S3.  And
that the rehearsal would have caught the defect the module had: nodes that run under their
host name boot alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from infra.cloud.rehearsal.render import CloudConfig
from infra.cloud.rehearsal.run import RehearsalError, RehearsalOptions, boot_and_check
from infra.cloud.rehearsal.services import systemd_env_file
from infra.cloud.toolchain import ToolchainError, detect
from infra.local.settings import PROJECT_ROOT, load_settings
from tests.helpers import run_to_end

# the first test also boots both clusters (the module fixture): ~4 min here, more beside the suite
pytestmark = [
    pytest.mark.integration,
    pytest.mark.terraform,
    pytest.mark.postgres,  # the Spark job's catalog database, where RDS would be
    pytest.mark.slow,
    pytest.mark.timeout(1380),
]

FEDGATE = Path(sys.executable).with_name("fedgate")
#: the tests' own subnet and names, apart from a rehearsal an operator runs beside them
SUBNET = "10.254.90.0/24"
PREFIX = "fgrhtest"


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """`fedgate cloud-rehearsal --json` once (what `make cloud-rehearsal` runs): its report and
    its folder."""
    settings = load_settings(env={})
    try:
        detect(
            terraform_bin=settings.terraform_bin,
            mirror=settings.tf_plugin_mirror,
            cache_dir=settings.cache_dir,
            require_mirror=True,
        )
    except ToolchainError as e:
        pytest.skip(f"the rehearsal renders cloud-init with Terraform: {e}")
    if os.geteuid() != 0:
        pytest.skip("the rehearsal's instances are network namespaces, which need root")
    work = tmp_path_factory.mktemp("rehearsal")
    # within the module's timeout (1,380 s): a rehearsal that overruns is stopped as an
    # operator stops it, and what it started is gone before the next test.  ~4 min alone here;
    # one CI machine beside the suite needed more than 13 (its routers installed in 33 s
    # rather than 5, its Spark job had no rows after 342 s rather than 44): the cap is 5x.
    done = run_to_end(
        [
            str(FEDGATE),
            "cloud-rehearsal",
            "--json",
            "--work-dir",
            str(work),
            "--subnet",
            SUBNET,
            "--prefix",
            PREFIX,
        ],
        1200,
        grace=90,
        cwd=PROJECT_ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout), work


def _no_leftovers() -> None:
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert PREFIX not in links
    assert PREFIX not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    # the instances' own /etc/hosts (the internal load balancer's name) went with them
    assert not list(Path("/etc/netns").glob(f"{PREFIX}-*"))


@pytest.mark.parametrize("cluster", ["backend", "gateway"])
def test_the_modules_nodes_form_one_cluster_that_survives_an_instance(rehearsal, cluster: str) -> None:
    """Tried: the example's nodes booted from their rendered cloud-init; a quorum queue filled
    through one node; one instance SIGKILLed; more sent through another."""
    reports, work = rehearsal
    report = reports[cluster]
    addresses = {f"{PREFIX}-n{i}": f"10.254.90.{10 + i}" for i in (1, 2, 3)}
    names = sorted(f"rabbit@{a}" for a in addresses.values())
    # each node is named after the address the metadata service told it, asked with a token
    assert report["node_names"] == {n: f"rabbit@{a}" for n, a in addresses.items()}
    for address in addresses.values():
        assert ["PUT", "/latest/api/token", address] in report["imds_requests"]
        assert ["GET", "/latest/meta-data/local-ipv4", address] in report["imds_requests"]
    # what the rehearsal changed of the rendered config: AWS peer discovery, nothing else
    assert report["peer_discovery"][0] == "cluster_formation.peer_discovery_backend = aws"
    assert all(line.startswith("cluster_formation.") for line in report["peer_discovery"])
    # one cluster, as each node sees it
    assert report["cluster_seen_by"] == {n: names for n in addresses}
    assert report["queue_members"] == names
    # nothing confirmed was lost when an instance died
    assert report["confirmed_before_kill"] == report["confirmed_after_kill"] == 100
    assert report["consumed"] == 200
    survivors = sorted(f"rabbit@{addresses[n]}" for n in addresses if n != report["killed"])
    assert report["running_after_kill"] == {n: survivors for n in addresses if n != report["killed"]}
    # gateways: MQTT (client ids tracked by a majority) answers on the two nodes left; the
    # admin is no device, and the gateway's own authentication plugin says so
    if cluster == "gateway":
        assert set(report["mqtt_after_kill"]) == set(report["running_after_kill"])
        assert all(code in (0, 4, 5) for code in report["mqtt_after_kill"].values()), report[
            "mqtt_after_kill"
        ]
    else:
        assert report["mqtt_after_kill"] == {}
    # the cloud-init it booted is kept for the operator to read
    user_data = (work / cluster / "user-data").read_text()
    assert user_data.startswith("#cloud-config")
    _no_leftovers()


def test_the_backends_routers_install_from_the_release_and_carry_every_reading_into_kafka(rehearsal) -> None:
    """Tried: the routers' launch template's cloud-init carried out on two instances (the
    installer against moto's S3 and Secrets Manager, the instance id from the metadata
    service); 100 readings delivered to the backend as a region's link delivers them; the
    router that bridged them SIGKILLed; 100 more; the router left stopped with SIGTERM."""
    reports, work = rehearsal
    report = reports["backend"]
    routers = {f"{PREFIX}-s{i}": f"10.254.90.{20 + i}" for i in (1, 2)}
    # each instance's own id (its presence queue's name), from the metadata service it asked
    for name, address in routers.items():
        instance_id = "i-" + "".join(f"{int(b):02x}" for b in address.split("."))
        assert report["routers"][name]["router_id"] == f"router-{instance_id}"
        # the release's code runs, from the venv the installer made (not this checkout)
        venv = work / "backend" / "instances" / name / "opt" / "fedgate" / "venv"
        assert report["routers"][name]["code"].startswith(str(venv)), report["routers"][name]
        # the secret's passwords: in the unit's environment file, for root only; none in the config
        env_file = work / "backend" / "instances" / name / "etc" / "fedgate" / "router.env"
        assert env_file.stat().st_mode & 0o777 == 0o600
        env = systemd_env_file(env_file.read_text())
        passwords = [v for k, v in env.items() if k.endswith("_PASSWORD")]
        assert len(passwords) == 2 and all(passwords)  # Kafka's, the backend management API's
        toml = (work / "backend" / "instances" / name / "etc" / "fedgate" / "router.toml").read_text()
        assert not any(secret in toml for secret in [*passwords, env["FEDGATE_ROUTER_AMQP_URL"]])
    assert report["routers_healthy"] == sorted(routers)
    # what the rehearsal changed of the routers' rendered config: Kafka's size and CA, nothing else
    assert report["router_overrides"] == ["FEDGATE_ROUTER_KAFKA_CA_FILE", "FEDGATE_ROUTER_KAFKA_REPLICATION"]
    # both bridged readings: the shards are shared out by rendezvous hashing of the routers'
    # ids (the module's shard_owner; before, the first router to register took every shard);
    # the one killed had bridged readings, and with it gone the other took its shards
    assert all(n >= 1 for n in report["bridged_before_kill"].values()), report["bridged_before_kill"]
    assert report["kafka_readings"] == 200
    assert report["kafka_regions"] == ["eu-west-1"]
    (survivor,) = set(routers) - {report["router_killed"]}
    assert report["router_exit_codes"] == {survivor: 0}
    _no_leftovers()


def test_the_backends_spark_job_turns_the_routers_readings_into_table_rows(rehearsal) -> None:
    """Tried: the Spark job's launch template's cloud-init on a third instance (the installer
    with the release's jars), its catalog database by the RDS endpoint's name (a PostgreSQL
    server standing in), its tables in moto's S3, reading the 200 readings the routers put in
    Kafka; then SIGTERM."""
    reports, work = rehearsal
    report = reports["backend"]
    venv = work / "backend" / "instances" / f"{PREFIX}-s3" / "opt" / "fedgate" / "venv"
    assert report["spark_code"].startswith(str(venv)), report["spark_code"]
    jars = work / "backend" / "instances" / f"{PREFIX}-s3" / "opt" / "fedgate" / "jars"
    assert any(p.name.startswith("iceberg-spark-runtime") for p in jars.iterdir())
    assert any(p.name.startswith("postgresql") for p in jars.iterdir())
    # every reading the routers bridged is one row, read through the catalog without Spark
    assert (report["spark_rows"], report["spark_ids"]) == (200, 200)
    # what the rehearsal changed: S3's endpoint and credentials, Kafka's CA, the jars' folder,
    # and the JVM options the suite gives every Spark driver (tests/conftest.py), if any
    assert report["spark_overrides"] == sorted(
        [
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "FEDGATE_SPARK_JARS_DIR",
            "FEDGATE_SPARK_KAFKA_CA_FILE",
            "FEDGATE_SPARK_S3_ENDPOINT",
            *(["FEDGATE_SPARK_JAVA_OPTIONS"] if os.environ.get("FEDGATE_SPARK_JAVA_OPTIONS") else []),
        ]
    )
    assert report["spark_exit_code"] == 0
    _no_leftovers()
    # its own catalog server's folder only: another lane's Spark tests run a PostgreSQL of their own
    assert report["catalog_server_dir"].startswith("/tmp/fedgate-postgres-")
    assert not Path(report["catalog_server_dir"]).exists()


def test_nodes_running_under_their_host_name_would_boot_alone(rehearsal) -> None:
    """Tried: the same cloud-init without the node-name step and its guard (the module as it
    was): the rehearsal fails; the nodes, named after the host, are none of the peers listed."""
    _, work = rehearsal
    cloud = CloudConfig.parse((work / "backend" / "user-data").read_text())
    password = re.search(r"^default_pass = (.+)$", cloud.files["/etc/rabbitmq/rabbitmq.conf"].content, re.M)
    assert password is not None
    runcmd = []
    for cmd in cloud.runcmd:
        if cmd[0].endswith("fedgate-rabbitmq-nodename"):
            continue
        if cmd[:2] == ("sh", "-c"):
            # the guard that refuses to start a node without its IP name
            cmd = ("sh", "-c", re.sub(r"^grep -q '\^NODENAME=rabbit@'.*?exit 1; \}; ", "", cmd[2]))
            assert "NODENAME" not in cmd[2]
        runcmd.append(cmd)
    before = CloudConfig(cloud.files, cloud.packages, tuple(runcmd))
    options = RehearsalOptions(work_dir=work / "host-names", subnet=SUBNET, prefix=PREFIX, form_timeout_s=45)
    with pytest.raises(RehearsalError) as failed:
        boot_and_check(load_settings(env={}), options, before, password.group(1), lambda msg: None)
    # no cluster: the nodes wait for peers they can never reach, then give up
    assert re.search(r"no cluster of 3|exited while forming", str(failed.value)), str(failed.value)
    for i in (1, 2, 3):
        logs = list(
            (options.work_dir / "instances" / f"{PREFIX}-n{i}" / "var/log/rabbitmq").glob("rabbit@*.log")
        )
        # named after the host, not its address: absent from the peers AWS would list
        assert logs and all("10.254.90." not in log.name for log in logs), logs
        assert "list of nodes does not contain the local node" in logs[0].read_text()
    _no_leftovers()
