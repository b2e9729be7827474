"""build_session never hands back a session of this process that uses another catalog."""

from __future__ import annotations

import dataclasses
import os

import pytest

from spark.session import DRIVER_GC, SparkSetupError, build_session, gc_option, local_master


def test_a_session_for_another_warehouse_is_refused_while_one_runs(spark, spark_settings, tmp_path):
    """Tried: the package's session running, a session asked for another warehouse (as the
    benchmarks' quick run once did after the unit tests): a clear error, not their tables."""
    other = dataclasses.replace(spark_settings, warehouse=str(tmp_path / "other-warehouse"))
    with pytest.raises(SparkSetupError, match=r"already runs a Spark session for another catalog"):
        build_session(other, "fedgate-other", kafka=False)


def test_the_same_catalog_gets_the_running_session(spark, spark_settings):
    assert build_session(spark_settings, "fedgate-unit-again", kafka=False) is spark


def test_the_driver_marks_its_old_generation_late_unless_told_otherwise(spark):
    """The running driver (started with the tests' JIT options, no collector named) runs
    DRIVER_GC: G1, its marking threshold fixed at 70 % of the heap.  Options that name a
    collector keep theirs, as two would not start."""
    jvm = spark._jvm
    beans = jvm.java.lang.management.ManagementFactory.getGarbageCollectorMXBeans()
    assert "G1 Young Generation" in {bean.getName() for bean in beans}
    hotspot = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean")
    )
    assert hotspot.getVMOption("InitiatingHeapOccupancyPercent").getValue() == "70"
    assert hotspot.getVMOption("G1UseAdaptiveIHOP").getValue() == "false"
    assert gc_option("-XX:TieredStopAtLevel=1") == DRIVER_GC
    assert gc_option("-Xmx2g -XX:+UseParallelGC") == ""
    assert gc_option("-XX:+UseZGC -XX:+ZGenerational") == ""


def test_a_local_master_gets_a_spare_task_slot_and_its_batches_keep_its_cores(spark):
    """local[N] starts N + spare slots, its batches cut in N tasks (the count beside a
    backlog batch gets a slot); local[*] counts this machine's cores; a cluster's master and
    a spare of 0 are left as they are.  The tests' own session, local[1], runs two slots."""
    assert local_master("local[2]", 1) == ("local[3]", 2)
    assert local_master("local[*]", 2)[1] == os.cpu_count()
    assert local_master("local[2]", 0) == ("local[2]", None)
    assert local_master("spark://10.0.0.5:7077", 1) == ("spark://10.0.0.5:7077", None)
    assert spark.sparkContext.master == "local[2]"
    assert spark.sparkContext.defaultParallelism == 1
