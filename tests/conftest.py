"""Shared fixtures: a real local federation (RabbitMQ nodes + Kafka) for integration tests.

The session fixture starts its own federation in a temporary state dir on
its own port block (FEDGATE_TEST_PORT_BASE, default 27000; the second
federation lane's 1000 below it: lane_port_base), so it never
touches a federation `make demo` left running, and always stops what it
started -- asserting that no process is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from infra.local.driver import LocalFederation
from infra.local.settings import PROJECT_ROOT, load_settings
from router.topics import DEFAULT_RULES

pytest_plugins = ["tests.cpu_usage"]

#: Every JVM the tests start (Kafka brokers, Spark drivers and executors) compiles with C1 only:
#: the suite's JVMs live for seconds to minutes and C2's compiles were a third of their CPU
#: (the Spark catalog tests: 75-80 -> 53-56 CPU s), on two cores shared by four lanes.  The
#: JIT level changes no behaviour that a test checks; `make bench` runs with the defaults.
#: C1 alone makes the JVM reserve 48 MB of code cache instead of 240: the Spark job filled it
#: within minutes, the JVM disabled its compiler ("CodeCache is full") and the job, interpreted,
#: wrote no rows before the tests' deadlines.  So the code cache keeps its tiered size.
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m"
# for the federations and Spark sessions the tests start in this process and in the commands
# they run (`fedgate up`, the benchmarks' quick run), which read the environment
os.environ.setdefault("FEDGATE_KAFKA_OPTS", TEST_JVM_OPTIONS)
os.environ.setdefault("FEDGATE_SPARK_JAVA_OPTIONS", TEST_JVM_OPTIONS)
#: Terraform and its AWS provider (Go) collect garbage at a quarter of Go's default pace in the
#: suite: the provider is started afresh by every terraform command (~120 a run), and builds
#: a ~400 MB schema each time.  `terraform validate` of a module: 3.3 -> 2.5 CPU s, for ~40 MB
#: more while it runs; the suite's terraform commands were ~420 of its ~2,300 CPU s.
os.environ.setdefault("GOGC", "400")

TEST_PORT_BASE = int(os.environ.get("FEDGATE_TEST_PORT_BASE", "27000"))
PARK_TTL_S = 25
#: A mapping rule the session federation has besides the default one (test_mapping_rules.py)
ENERGY_RULE = {
    "pattern": "devices/{device}/energy/{kind:power|total}",
    "topic": "energy.{kind}",
    "key": "{device}",
}
#: The session federation's [router] table: rules replace the default list, so it comes last
ROUTER_TABLE = {
    # a short parking TTL so that expiry can be tested
    "park_ttl_s": PARK_TTL_S,
    # the gateways' connection lists checked often, so that a test sees it within seconds
    "presence_reconcile_s": 3.0,
    # a stalled producer found within the chaos tests' 45 s fault (a frozen partition leader),
    # while a Kafka away for 30 s must not be taken for one (tests/chaos)
    "kafka_stall_s": 20.0,
    "rules": [ENERGY_RULE, *({"pattern": r.pattern, "topic": r.topic, "key": r.key} for r in DEFAULT_RULES)],
}


def missing_runtime() -> str | None:
    """Why integration tests cannot run on this machine, or None."""
    from infra.local.broker import BrokerRuntimeError
    from infra.local.nodes import runtime_of

    try:
        runtime_of(load_settings(env={}, **release_override())).check("RabbitMQ")
    except BrokerRuntimeError as e:
        return str(e)
    if not shutil.which("java"):
        return "no Java runtime (run `make setup`)"
    if not list((PROJECT_ROOT / ".cache" / "jars").glob("kafka-*/.complete")):
        return "Kafka jars not downloaded (run `make setup`)"
    if not list((PROJECT_ROOT / ".cache" / "jars").glob("spark-*/iceberg-spark-runtime*.jar")):
        return "Spark's Kafka source and Iceberg jars not downloaded (run `make setup`)"
    return None


def missing_java() -> str | None:
    """What a local SparkSession lacks here: Java, or the jars `make setup` fetches (`make
    unit` runs on the virtualenv alone)."""
    if not shutil.which("java"):
        return "no Java runtime for a local SparkSession (run `make setup`)"
    from spark.session import SparkSetupError, spark_jars
    from spark.settings import SparkSettings

    try:
        spark_jars(SparkSettings(kafka_bootstrap="-", warehouse="-"), kafka=False)
    except SparkSetupError as e:
        return str(e)
    return None


def missing_chromium() -> str | None:
    return None if os.access("/usr/bin/chromium", os.X_OK) else "no /usr/bin/chromium (run `make setup`)"


def missing_postgres() -> str | None:
    from infra.local.postgres import PostgresError, server_bin

    try:
        server_bin()
    except PostgresError as e:
        return str(e)
    return None


#: `make test`'s lanes, one pytest-xdist worker each.  A lane's tests run one at a time, in
#: collection order but for PLACE_IN_LANE; the lanes run side by side.  The suite is CPU-bound
#: (two cores ~1.8 busy), and two federations under fault at once overload them: the order
#: within the lanes keeps the session federation's fault scenarios for after the HA profile's.
#: - "federation": the session federation's tests: the plain ones first, then Spark's, then
#:   the fault scenarios (tests/chaos), by when the HA profile's are done;
#: - "federation-2": plain tests that need no Spark job (FEDERATION_2) on a session federation
#:   of that lane's own (lane_port_base; its Spark job never starts), then the cloud
#:   rehearsal (nodes in network namespaces);
#: - "ha": tests/ha on the HA profile's federation (the node-loss scenarios, then the HA
#:   benchmark's quick run), then the Spark cluster's tests (a standalone cluster and a
#:   Kafka broker of their own, ~5 min);
#: - "unit": no brokers (Spark's local session among them), then the benchmarks' quick run
#:   but the HA one's (a federation of its own; its checks count rather than time);
#: - "terraform" and "terraform-2": Terraform's AWS provider against moto (its waiters sleep
#:   10-60 s between polls: these lanes wait, they hardly compute), split in two
#:   (TERRAFORM_2), the second then running what starts engines of its own: PowerDNS, a
#:   benchmark stopped, `fedgate up` and `down` from nothing.
#: Five lanes took 21:00-21:40 on 2026-11-30, the federation's the longest (1,273 s of tests;
#: the others 881-1,104): its second session federation (~35 s to boot, ~0.05 cores idle)
#: takes 385 s of them, and the cloud rehearsal (431 s) leaves the HA lane.  Six lanes took
#: 19:13 (r16), the unit and Terraform lanes then the longest (1,129 and 1,111 s), the HA
#: lane 720: the Spark cluster's tests (289 s) moved there from the first Terraform lane.
LANES = ("federation", "federation-2", "ha", "unit", "terraform", "terraform-2")
#: The plain tests of the second session federation: none starts the Spark job or a fault
#: that the federation's own lane runs (those come after the HA profile's, one at a time).
FEDERATION_2 = {
    "tests/integration/test_army.py",
    "tests/integration/test_command_acks.py",
    "tests/integration/test_regions.py",
    "tests/integration/test_router.py",
}
#: The Terraform files of the second Terraform lane (~9 of the ~20 min of their waits).
TERRAFORM_2 = {
    "tests/unit/cloud/test_backend_routers.py",
    "tests/unit/cloud/test_fedgate_service.py",
    "tests/unit/cloud/test_route53_and_regions.py",
    "tests/unit/cloud/test_terraform_apply_moto.py",
    "tests/unit/cloud/test_terraform_modules.py",
}
OWN_ENGINES = {
    "tests/ha/test_ha_node_loss.py": "ha",
    "tests/ha/test_ha_double_fault.py": "ha",
    "tests/ha/test_ha_bench.py": "ha",
    "tests/integration/test_cloud_rehearsal.py": "federation-2",
    "tests/integration/test_bench.py": "unit",
    "tests/integration/test_spark_cluster.py": "ha",
    "tests/integration/test_dns.py": "terraform-2",
    "tests/integration/test_bench_stop.py": "terraform-2",
    "tests/integration/test_up_down.py": "terraform-2",
}
#: Where a file runs within its lane (0: in collection order; tests/chaos 2, place_in_lane):
#: OWN_ENGINES in its order, after the unit tests in theirs.
PLACE_IN_LANE = {
    # the session federation's Spark job starts with the first of these (`spark_job`)
    "tests/integration/test_demo.py": 1,
    "tests/integration/test_lifecycle.py": 1,
    "tests/integration/test_mapping_rules.py": 1,
    "tests/integration/test_spark.py": 1,
    # a fault (a region's gateway killed): with the fault scenarios
    "tests/integration/test_console.py": 2,
    **{path: n + 1 for n, path in enumerate(OWN_ENGINES)},
}


#: Unit tests in the first Terraform lane, whose tests wait more than they compute: the unit
#: lane (Spark's catalog tests, then the benchmarks' quick run) was the longest in r16.
UNIT_IN_TERRAFORM = {"tests/unit/spark/test_class_archive.py"}


def lane_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/unit/cloud/") or path in UNIT_IN_TERRAFORM:
        return "terraform-2" if path in TERRAFORM_2 else "terraform"
    if path.startswith("tests/unit/"):
        return "unit"
    if path in FEDERATION_2:
        return "federation-2"
    if path.startswith("tests/ha/"):  # one HA federation on its ports: a second would collide
        return "ha"
    return OWN_ENGINES.get(path, "federation")


def lane_port_base(lane: str) -> int:
    """The port block of a lane's session federation: each lane runs in a process of its own."""
    return TEST_PORT_BASE - 1000 if lane == "federation-2" else TEST_PORT_BASE


#: The lane of the test being set up: the session federation starts with a lane's first test
#: (pytest_runtest_setup runs before its fixtures), on that lane's ports.
CURRENT_LANE: list[str] = ["federation"]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    CURRENT_LANE[0] = lane_of(item.nodeid)


def place_in_lane(nodeid: str) -> int:
    path = nodeid.split("::", 1)[0]
    if path in PLACE_IN_LANE:
        return PLACE_IN_LANE[path]
    return 2 if path.startswith("tests/chaos/") else 0


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test` runs one pytest-xdist worker per lane (LANES).

    (xdist's own `--dist loadgroup` cannot say this under pytest 9: it marks a group in
    `item._nodeid`, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid)

    return Lanes(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from infra.dns.powerdns import missing as missing_powerdns

    # xdist hands the lanes out in the order their first test was collected: the longest
    # lane (the federation's) first, so that it has a worker of its own from the start; the
    # sort is stable, so collection order holds within a lane but for PLACE_IN_LANE
    def place(item: pytest.Item) -> tuple[int, int]:
        return LANES.index(lane_of(item.nodeid)), place_in_lane(item.nodeid)

    items.sort(key=place)

    for marker, reason in (
        ("integration", missing_runtime()),
        ("spark", missing_java()),
        ("dns", missing_powerdns()),
        ("postgres", missing_postgres()),
        ("browser", missing_chromium()),
    ):
        needing = [item for item in items if marker in item.keywords]
        if reason is None or not needing:
            continue
        if os.environ.get("FEDGATE_REQUIRE_RUNTIME"):
            # `make test` ran `make setup` first: a missing runtime is a broken
            # install step, not a machine that lacks something -- fail, don't skip.
            raise pytest.UsageError(f"{marker} runtime missing after make setup: {reason}")
        for item in needing:
            item.add_marker(pytest.mark.skip(reason=reason))


def release_override() -> dict[str, str]:
    """FEDGATE_RABBITMQ_RELEASE chooses the RabbitMQ release of every test federation."""
    release = os.environ.get("FEDGATE_RABBITMQ_RELEASE")
    return {"rabbitmq_release": release} if release else {}


#: Seconds a test federation's node may take to be ready: a node booted while the other
#: lanes load the machine took over 90 s (the default) on CI, where the same tests took
#: 1.5-5 times as long as on the developers' machines, and an HA node restarted after SIGKILL
#: recovers its logs (Kafka) or quorum members (RabbitMQ) under the devices' load first.
#: Only a boot that fails waits it out.
SUITE_BOOT_TIMEOUT_S = 180.0


#: The test federations' Spark jobs count their batches in the aggregates when a test asks
#: (count_aggregates_now, as `fedgate count-now` does), not on the minute's clock, which
#: counted ~10 times a run for no test.  Measured, it saved little: the HA job's CPU went from
#: 128.7 to 122.5 s (the "(12.9 s)" of a count in the job's log is wall time under load, not
#: CPU).  The clock itself is the Spark cluster's test's (test_spark_cluster.py, every 5 s).
TEST_AGGREGATE_INTERVAL_S = 3600.0


def make_federation(state_dir: Path, port_base: int, **overrides: object) -> LocalFederation:
    jvm = {
        "kafka_opts": os.environ["FEDGATE_KAFKA_OPTS"],
        "spark_java_options": os.environ["FEDGATE_SPARK_JAVA_OPTIONS"],
    }
    overrides = {
        "boot_timeout": SUITE_BOOT_TIMEOUT_S,
        "spark_aggregate_interval_s": TEST_AGGREGATE_INTERVAL_S,
        **release_override(),
        **jvm,
        **overrides,
    }
    settings = load_settings(env={}, state_dir=state_dir, port_base=port_base, **overrides)
    return LocalFederation(settings, progress=lambda msg: print(f"[federation] {msg}", flush=True))


@contextmanager
def running(fed: LocalFederation, spark_job: bool = True) -> Iterator[LocalFederation]:
    """`fed` up for the block, then down, with none of its processes left behind."""
    try:
        fed.up(spark_job=spark_job)
        yield fed
    finally:
        fed.down()
        left = fed.leftover_pids()
        assert not left, f"processes left behind by down: {left}"


@pytest.fixture(scope="session")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    # one lane's tests at a time in a worker (the lanes' scheduler); run without it, the first
    # test's lane picks the ports and every test shares the one federation
    fed = make_federation(
        tmp_path_factory.mktemp("federation"),
        lane_port_base(CURRENT_LANE[0]),
        router=ROUTER_TABLE,
        # compaction runs between the tests' batches a few times a run, not once in 10
        # minutes (the aggregates count when a test asks: TEST_AGGREGATE_INTERVAL_S)
        spark_compact_interval_s=300,
    )
    # the Spark job starts with the first test that needs it (`spark_job`): landing the
    # plain tests' readings batch by batch as they came was the job's largest cost, one
    # batch of them all at its start is a fraction of it
    with running(fed, spark_job=False):
        SESSION_FEDERATION.append(fed)
        yield fed


#: The session federation while it runs (`federation`), for pytest_runtest_teardown to stop.
SESSION_FEDERATION: list[LocalFederation] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """The session federation stops after the last test that uses it, not at the session's
    end: the second federation's lane runs the cloud rehearsal after its plain tests, ~10
    minutes its six engines would idle beside (~0.07 cores).  After the test's own fixtures
    are torn down (hookwrapper: after the rest of the teardown)."""
    yield
    if not SESSION_FEDERATION or nextitem is None:
        return
    items = item.session.items
    if any("federation" in later.fixturenames for later in items[items.index(nextitem) :]):
        return
    fed = SESSION_FEDERATION.pop()
    fed.down()  # `running` calls it again at the session's end: a no-op then
    left = fed.leftover_pids()
    assert not left, f"processes left behind by down: {left}"


@pytest.fixture
def spark_job(federation: LocalFederation) -> LocalFederation:
    """The session federation with its Spark job running: each test finds it so, even after
    one that killed it and failed before starting it again."""
    federation.start_node("spark")  # nothing when it runs
    return federation


@pytest.fixture
def endpoints(federation: LocalFederation) -> dict:
    """The federation's endpoints, and `credentials(device_id)` -> (user, secret) for test devices."""
    from tests.helpers import DeviceCredentials

    return {**federation.endpoints(), "credentials": DeviceCredentials(federation)}


@pytest.fixture
def uid() -> str:
    """A short random id for per-test device, queue and topic names."""
    return uuid.uuid4().hex[:8]


#: (test, counts) of every fault scenario run in this session, from the tests' reports:
#: under pytest-xdist the scenarios run in a worker, and only their reports reach here
CHAOS_COUNTS: list[tuple[str, dict]] = []


@pytest.fixture(autouse=True)
def _counts_go_in_the_report(request: pytest.FixtureRequest) -> Iterator[None]:
    from tests import helpers

    helpers.CURRENT_ITEM = request.node
    yield
    helpers.CURRENT_ITEM = None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos-counts",
        metavar="FILE",
        help="append each fault scenario's counts to FILE (JSON lines) as it ends: a loop stopped "
        "by a signal keeps what it counted",
    )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        CALL_OUTCOMES[report.nodeid] = report.outcome
    if report.when != "teardown":  # the last report of a test: every count recorded by then
        return
    counts = [(report.nodeid, dict(value)) for name, value in report.user_properties if name == "chaos"]  # type: ignore[call-overload]
    CHAOS_COUNTS.extend(counts)
    out = CHAOS_COUNTS_FILE[0] if CHAOS_COUNTS_FILE else None
    outcome = CALL_OUTCOMES.pop(report.nodeid, "error")
    if out and counts:
        with open(out, "a") as f:
            f.writelines(json.dumps({"test": t, "outcome": outcome, **v}) + "\n" for t, v in counts)


CALL_OUTCOMES: dict[str, str] = {}
#: --chaos-counts, read once the options are parsed (the report hook has no config)
CHAOS_COUNTS_FILE: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    # written where every report arrives: the controller under pytest-xdist, not its workers
    if (out := config.getoption("--chaos-counts", None)) and not hasattr(config, "workerinput"):
        CHAOS_COUNTS_FILE.append(str(Path(out).resolve()))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The fault scenarios' counts (tests/chaos): what was sent, what arrived, what was lost."""
    if not CHAOS_COUNTS:
        return
    terminalreporter.section("chaos: sent, received, lost, duplicated")
    for test, counts in CHAOS_COUNTS:
        terminalreporter.write_line(f"{test}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
