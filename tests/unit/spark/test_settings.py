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
        (
            'kafka_bootstrap = "k"\nwarehouse = "w"\nfreshness_target_s = -4\n',
            "^freshness_target_s: must be >= 0",
        ),
        (
            'kafka_bootstrap = "k"\nwarehouse = "w"\naggregate_after_rows = -5\n',
            "^aggregate_after_rows: must be >= 0",
        ),
        (
            'kafka_bootstrap = "k"\nwarehouse = "w"\nlocal_spare_slots = -1\n',
            "^local_spare_slots: must be >= 0",
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


def test_an_s3_warehouse_is_spelled_s3a_and_needs_a_shared_catalog():
    with pytest.raises(SparkSettingsError, match=r"^warehouse: write s3a://bucket/wh"):
        SparkSettings(kafka_bootstrap="k", warehouse="s3://bucket/wh", catalog_uri="jdbc:sqlite:/c.db")
    with pytest.raises(SparkSettingsError, match=r"^catalog_uri: required"):
        SparkSettings(kafka_bootstrap="k", warehouse="s3a://bucket/wh")


def test_an_s3_warehouse_configures_s3a_for_the_tables_and_the_checkpoints():
    from spark.session import s3a_conf

    local = SparkSettings(kafka_bootstrap="k", warehouse="/wh")
    assert not local.on_s3 and s3a_conf(local) == {}, "a local warehouse configures no S3 client"
    s3 = SparkSettings(
        kafka_bootstrap="k",
        warehouse="s3a://bucket/wh",
        catalog_uri="jdbc:sqlite:/c.db",
        s3_endpoint="http://127.0.0.1:9000",
        s3_region="eu-west-1",
    )
    conf = s3a_conf(s3)
    assert s3.checkpoint_dir == "s3a://bucket/wh/_checkpoints"
    assert conf["spark.hadoop.fs.s3a.endpoint"] == "http://127.0.0.1:9000"
    assert conf["spark.hadoop.fs.s3a.path.style.access"] == "true"
    assert conf["spark.hadoop.fs.s3a.connection.ssl.enabled"] == "false"
    assert conf["spark.hadoop.fs.s3a.endpoint.region"] == "eu-west-1"
    assert not any("key" in k for k in conf), "credentials never come from settings"
    on_aws = s3a_conf(
        SparkSettings(kafka_bootstrap="k", warehouse="s3a://b/wh", catalog_uri="jdbc:sqlite:/c.db")
    )
    assert "spark.hadoop.fs.s3a.endpoint" not in on_aws, "AWS's own endpoint, found by region"


def test_a_postgresql_catalog_is_reached_with_its_login_by_spark_and_by_python(monkeypatch):
    """The cloud's catalog (RDS PostgreSQL): the password from the environment, the same
    database for Spark's JDBC catalog and pyiceberg's SQL catalog (its password URL-quoted)."""
    from spark.reading import CatalogError, sqlalchemy_uri
    from spark.session import iceberg_catalog_conf

    monkeypatch.setenv("FEDGATE_SPARK_CATALOG_PASSWORD", "p@ss/word")
    s = SparkSettings.load(
        kafka_bootstrap="k:9092",
        warehouse="s3a://bucket/warehouse",
        catalog_uri="jdbc:postgresql://db.example:5432/fedgate",
        catalog_user="fedgate",
    )
    assert s.catalog_password == "p@ss/word"
    conf = iceberg_catalog_conf(s)
    assert conf["spark.sql.catalog.fedgate.uri"] == "jdbc:postgresql://db.example:5432/fedgate"
    assert conf["spark.sql.catalog.fedgate.jdbc.user"] == "fedgate"
    assert conf["spark.sql.catalog.fedgate.jdbc.password"] == "p@ss/word"
    # SQLite's connection settings are SQLite's only
    assert not any(k.endswith(("journal_mode", "busy_timeout")) for k in conf)
    assert (
        sqlalchemy_uri(s.catalog_jdbc_uri, s.catalog_user, s.catalog_password)
        == "postgresql+psycopg2://fedgate:p%40ss%2Fword@db.example:5432/fedgate"
    )
    with pytest.raises(CatalogError, match="SQLite or PostgreSQL"):
        sqlalchemy_uri("jdbc:mysql://db.example/fedgate")
