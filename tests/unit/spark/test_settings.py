"""The Spark job's settings: file, then FEDGATE_SPARK_* variables, then overrides; errors name the field."""

from __future__ import annotations

import pytest

from spark.settings import SparkSettings, SparkSettingsError


def test_file_then_environment_then_overrides(tmp_path, monkeypatch):
    cfg = tmp_path / "spark.toml"
    cfg.write_text('kafka_bootstrap = "127.0.0.1:1"\nwarehouse = "/wh"\ntrigger_s = 5\nmaster = "local[1]"\n')
    monkeypatch.setenv("FEDGATE_SPARK_TRIGGER_S", "3.5")
    s = SparkSettings.load(cfg, master="spark://cluster:7077")
    assert (s.trigger_s, s.master, s.warehouse) == (3.5, "spark://cluster:7077", "/wh")
    assert s.checkpoint_dir == "/wh/_checkpoints"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('kafka_bootstrap = "k"\nwarehouse = "w"\nbogus = 1\n', "unknown setting 'bogus'"),
        ('kafka_bootstrap = "k"\nwarehouse = "w"\ntrigger_s = "soon"\n', "^trigger_s: cannot read"),
        (
            'kafka_bootstrap = "k"\nwarehouse = "w"\ncompact_interval_s = -1\n',
            "^compact_interval_s: must be >= 0",
        ),
        ('warehouse = "w"\n', "^kafka_bootstrap: required"),
        ("kafka_bootstrap = \n", "config file .*spark.toml"),
    ],
)
def test_a_bad_setting_is_named(tmp_path, text, message):
    cfg = tmp_path / "spark.toml"
    cfg.write_text(text)
    with pytest.raises(SparkSettingsError, match=message):
        SparkSettings.load(cfg)


def test_the_job_reads_exactly_the_topics_it_is_given(tmp_path):
    cfg = tmp_path / "spark.toml"
    cfg.write_text(
        'kafka_bootstrap = "k"\nwarehouse = "w"\n'
        'topics = "energy.power,fedgate.deadletter,fedgate.unmatched,telemetry.telemetry"\n'
        'unmatched_topic = "fedgate.unmatched"\n'
    )
    s = SparkSettings.load(cfg)
    assert s.require_topics() == (
        "energy.power",
        "fedgate.deadletter",
        "fedgate.unmatched",
        "telemetry.telemetry",
    )
    cfg.write_text('kafka_bootstrap = "k"\nwarehouse = "w"\ntopics = ["energy.power", "telemetry.state"]\n')
    assert SparkSettings.load(cfg).topics == ("energy.power", "telemetry.state")


def test_the_job_has_no_topics_of_its_own():
    """Queries need no topics; the streaming job refuses to guess them."""
    s = SparkSettings.load(kafka_bootstrap="k", warehouse="w")
    assert s.topics == ()
    with pytest.raises(SparkSettingsError, match="^topics: required by the job"):
        s.require_topics()


def test_a_topic_kafka_would_refuse_is_named():
    with pytest.raises(SparkSettingsError, match="^topics: 'telemetry.\\*' is not a Kafka topic name"):
        SparkSettings.load(kafka_bootstrap="k", warehouse="w", topics="telemetry.*")
