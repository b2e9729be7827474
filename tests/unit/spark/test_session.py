"""build_session never hands back a session of this process that uses another catalog."""

from __future__ import annotations

import dataclasses

import pytest

from spark.session import DRIVER_GC, SparkSetupError, build_session, gc_option


def test_a_session_for_another_warehouse_is_refused_while_one_runs(spark, spark_settings, tmp_path):
    """Tried: the package's session running, a session asked for another warehouse (as the
    benchmarks' quick run once did after the unit tests): a clear error, not their tables."""
    other = dataclasses.replace(spark_settings, warehouse=str(tmp_path / "other-warehouse"))
    with pytest.raises(SparkSetupError, match=r"already runs a Spark session for another catalog"):
        build_session(other, "fedgate-other", kafka=False)


def test_the_same_catalog_gets_the_running_session(spark, spark_settings):
    assert build_session(spark_settings, "fedgate-unit-again", kafka=False) is spark


def test_the_driver_collects_with_the_throughput_collector_unless_told_otherwise(spark):
    """The running driver (started with the tests' JIT options, no collector named) uses
    DRIVER_GC; options that name a collector keep theirs, as two would not start."""
    beans = spark._jvm.java.lang.management.ManagementFactory.getGarbageCollectorMXBeans()
    assert {bean.getName() for bean in beans} == {"PS Scavenge", "PS MarkSweep"}
    assert gc_option("-XX:TieredStopAtLevel=1") == DRIVER_GC == "-XX:+UseParallelGC"
    assert gc_option("-Xmx2g -XX:+UseG1GC") == ""
    assert gc_option("-XX:+UseZGC -XX:+ZGenerational") == ""
