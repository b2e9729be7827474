"""Pure transforms from Kafka records to fedgate's tables.

Every function takes and returns DataFrames and works the same on a batch
frame (unit tests, the recompute) and on a streaming frame (the job).  Bad
input never raises: a record the tables cannot hold becomes a reject with a
reason, a row with a flaw keeps the flaw in `parse_error`.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from backend import contract as c

#: The payload field holding the device's send time: epoch seconds or
#: milliseconds (number) or an ISO 8601 string.
DEVICE_TS_FIELD = "ts"

#: A device timestamp further than this before Kafka's time is not believed
#: (a device with a dead clock): event_time falls back to Kafka time.
PLAUSIBLE_PAST = "7 days"
#: A reading cannot reach Kafka before it was sent: a device time after Kafka's
#: (the broker's append time) is a clock running fast, and event_time is clamped to
#: Kafka time: a minute of the aggregates never counts readings from its future.
#: (When the aggregates kept a watermark on event time, one device 5 minutes fast moved
#: it 5 minutes ahead and every other device's readings of those minutes fell behind it.)
#: Beyond this much ahead the row is flagged (parse_error) and has no latency; within
#: it, the usual skew of synchronised clocks, it is not.
CLOCK_AHEAD_TOLERANCE_MS = 2000

#: The device_minute row that counts all messages, whatever their fields.
ALL_MESSAGES_FIELD = "*"

RAW_COLUMNS = [
    "message_id",
    "device",
    "mqtt_topic",
    "user_properties",
    "kafka_topic",
    "kafka_partition",
    "kafka_offset",
    "payload",
    "fields",
    "numeric_fields",
    "device_ts",
    "received_at",
    "kafka_ts",
    "event_time",
    "latency_ms",
    "parse_error",
    "ingest_batch",
    "date",
    "region",
]


def _header(name: str) -> Column:
    # get() is NULL when absent; a header Kafka repeats keeps its first value
    return F.get(F.filter("headers", lambda h: h["key"] == F.lit(name)), 0)["value"].cast("string")


def _user_properties() -> Column:
    """The MQTT 5 user properties the bridge put in headers (mqtt.user.<name>), as a map;
    empty for an MQTT 3.1.1 device.  A name repeated keeps its last value
    (spark.sql.mapKeyDedupPolicy, spark/session.py): a repeated header never fails a batch."""
    prefix = c.KAFKA_USER_PROPERTY_PREFIX
    entries = F.transform(
        F.filter("headers", lambda h: h["key"].startswith(prefix)),
        lambda h: F.struct(
            F.substring(h["key"], len(prefix) + 1, 1 << 20).alias("key"),
            h["value"].cast("string").alias("value"),
        ),
    )
    return F.coalesce(F.map_from_entries(entries), F.create_map().cast("MAP<STRING,STRING>"))


def decode_kafka(
    records: DataFrame, unmatched_topic: str, deadletter_topic: str, max_bytes: int
) -> DataFrame:
    """Kafka source rows -> one row per record with the bridge's headers and a reject reason.

    `reject_reason` is NULL for a record that belongs in telemetry_raw.
    """
    mqtt_topic = _header(c.KAFKA_MQTT_TOPIC_HEADER)
    fallback_id = F.substring(
        F.sha2(
            F.concat(F.encode(F.coalesce(mqtt_topic, F.lit("")), "UTF-8"), F.unhex(F.lit("00")), "value"), 256
        ),
        1,
        32,
    )
    size = F.coalesce(F.length("value"), F.lit(0))
    df = records.select(
        F.col("topic").alias("kafka_topic"),
        F.col("partition").alias("kafka_partition"),
        F.col("offset").alias("kafka_offset"),
        F.col("timestamp").alias("kafka_ts"),
        mqtt_topic.alias("mqtt_topic"),
        F.coalesce(F.nullif(_header(c.KAFKA_REGION_HEADER), F.lit("")), F.lit("unknown")).alias("region"),
        _header(c.KAFKA_DEVICE_HEADER).alias("device"),
        F.timestamp_millis(_header(c.KAFKA_RECEIVED_AT_HEADER).cast("long")).alias("received_at"),
        F.coalesce(_header(c.KAFKA_MESSAGE_ID_HEADER), fallback_id).alias("message_id"),
        _header(c.KAFKA_DEADLETTER_REASON_HEADER).alias("deadletter_reason"),
        _user_properties().alias("user_properties"),
        size.alias("payload_bytes"),
        # the bridge dead-letters non-UTF-8 payloads; anything else decodes with U+FFFD
        F.when(size <= max_bytes, F.col("value").cast("string")).alias("payload"),
    )
    reason = (
        F.when(
            F.col("kafka_topic") == deadletter_topic,
            F.concat(F.lit("dead-lettered by the bridge: "), F.coalesce("deadletter_reason", F.lit("?"))),
        )
        .when(
            F.col("kafka_topic") == unmatched_topic,
            F.concat(F.lit("no mapping rule for MQTT topic "), F.coalesce("mqtt_topic", F.lit("?"))),
        )
        .when(
            F.col("mqtt_topic").isNull(), F.lit("record without fedgate headers (not produced by the bridge)")
        )
        .when(
            F.col("payload_bytes") > max_bytes,
            F.format_string(f"payload of %d bytes is over the limit of {max_bytes}", "payload_bytes"),
        )
        .when(F.col("device").isNull() | (F.col("device") == ""), F.lit("record names no device"))
    )
    return df.withColumn("reject_reason", reason)


def _device_ts(fields: Column) -> tuple[Column, Column]:
    """(device_ts, error) from the payload's timestamp field."""
    text = fields[DEVICE_TS_FIELD]
    number = text.cast("double")
    from_number = F.when(number > 1e11, F.timestamp_millis(number.cast("long"))).otherwise(
        F.timestamp_micros((number * 1e6).cast("long"))
    )
    parsed = F.when(number.isNotNull(), from_number).otherwise(F.to_timestamp(text))
    error = F.when(
        text.isNull(), F.lit(f"no device timestamp (field {DEVICE_TS_FIELD}); Kafka time used")
    ).when(
        parsed.isNull(),
        F.lit(f"device timestamp (field {DEVICE_TS_FIELD}) is neither epoch nor ISO 8601; Kafka time used"),
    )
    return parsed, error


def parse(decoded: DataFrame) -> DataFrame:
    """Decoded records -> the same records with every telemetry_raw column added (the
    payload's JSON, device time, event time, latency, parse_error), rejects too.

    The job parses on the stream itself, so that a micro-batch arrives parsed: each batch
    then only selects (accepted_rows, reject_rows) instead of building these expressions again.
    An invalid payload is kept as it came, with `parse_error` saying what is wrong.
    """
    fields = F.from_json("payload", "MAP<STRING,STRING>")
    df = decoded.withColumn("fields", fields)
    numeric = F.coalesce(
        F.map_filter(
            F.transform_values("fields", lambda k, v: v.cast("double")),
            lambda k, v: v.isNotNull() & (k != DEVICE_TS_FIELD) & ~F.isnan(v),
        ),
        F.create_map().cast("MAP<STRING,DOUBLE>"),
    )
    device_ts, ts_error = _device_ts(F.col("fields"))
    plausible = device_ts >= F.col("kafka_ts") - F.expr(f"INTERVAL {PLAUSIBLE_PAST}")
    ahead_ms = F.unix_millis(device_ts) - F.unix_millis(F.col("kafka_ts"))
    fast_clock = plausible & (ahead_ms > CLOCK_AHEAD_TOLERANCE_MS)
    not_object = F.when(
        F.col("fields").isNull(),
        F.when(F.ltrim("payload").startswith("{"), F.lit("payload is not valid JSON")).otherwise(
            F.lit("payload is not a JSON object")
        ),
    )
    implausible = F.when(
        device_ts.isNotNull() & ~plausible,
        F.lit(f"device timestamp more than {PLAUSIBLE_PAST} before Kafka time; Kafka time used"),
    ).when(
        fast_clock,
        F.format_string("device clock %.1f s ahead of Kafka time; event time clamped to it", ahead_ms / 1000),
    )
    return (
        df.withColumn("numeric_fields", numeric)
        .withColumn("device_ts", device_ts)
        .withColumn(
            "event_time",
            F.when(plausible, F.least(device_ts, F.col("kafka_ts"))).otherwise(F.col("kafka_ts")),
        )
        .withColumn("latency_ms", F.when(plausible & ~fast_clock, -ahead_ms))
        .withColumn(
            "parse_error",
            F.nullif(
                F.concat_ws("; ", not_object, F.when(F.col("fields").isNotNull(), ts_error), implausible),
                F.lit(""),
            ),
        )
        .withColumn("date", F.to_date("event_time"))
        # the micro-batch that wrote the row (set by the job; lineage and freshness)
        .withColumn("ingest_batch", F.lit(None).cast("long"))
    )


def accepted_rows(parsed: DataFrame) -> DataFrame:
    """Parsed records (parse) -> telemetry_raw rows: those without a reject reason."""
    return parsed.where(F.col("reject_reason").isNull()).select(*RAW_COLUMNS)


def raw_rows(decoded: DataFrame) -> DataFrame:
    """Decoded records (decode_kafka) -> telemetry_raw rows."""
    return accepted_rows(parse(decoded))


def reject_rows(decoded: DataFrame) -> DataFrame:
    return decoded.where(F.col("reject_reason").isNotNull()).select(
        "kafka_topic",
        "kafka_partition",
        "kafka_offset",
        "kafka_ts",
        "mqtt_topic",
        "region",
        "device",
        F.col("reject_reason").alias("reason"),
        "payload_bytes",
        F.substring(F.coalesce("payload", F.lit("")), 1, 200).alias("payload_preview"),
        F.to_date("kafka_ts").alias("date"),
    )


def device_minute(raw: DataFrame) -> DataFrame:
    """Per device and minute (of event time): for each numeric field count,
    min, max, avg and the last value; the row with field '*' counts all the
    device's messages of that minute."""
    entries = F.concat(
        F.array(
            F.struct(F.lit(ALL_MESSAGES_FIELD).alias("field"), F.lit(None).cast("double").alias("value"))
        ),
        F.transform(
            F.map_entries("numeric_fields"),
            lambda e: F.struct(e["key"].alias("field"), e["value"].alias("value")),
        ),
    )
    exploded = raw.select("device", "region", "event_time", F.explode(entries).alias("e")).select(
        "device", "region", "event_time", "e.field", "e.value"
    )
    agg = exploded.groupBy(F.window("event_time", "1 minute").alias("w"), "device", "field").agg(
        F.count(F.lit(1)).alias("count"),
        F.min("value").alias("min"),
        F.max("value").alias("max"),
        F.avg("value").alias("avg"),
        F.max_by("value", "event_time").alias("last"),
        F.max_by("region", "event_time").alias("region"),
    )
    return agg.select(
        F.to_date(F.col("w.start")).alias("date"),
        F.col("w.start").alias("minute"),
        "device",
        "region",
        "field",
        "count",
        "min",
        "max",
        "avg",
        "last",
    )


def region_minute(raw: DataFrame) -> DataFrame:
    """Per region and minute (of event time): messages, distinct devices and
    end-to-end latency (device send -> Kafka) percentiles."""
    agg = raw.groupBy(F.window("event_time", "1 minute").alias("w"), "region").agg(
        F.count(F.lit(1)).alias("messages"),
        F.approx_count_distinct("device", 0.01).alias("devices"),
        F.percentile_approx("latency_ms", [0.5, 0.95, 0.99], 10000).alias("p"),
        F.max("latency_ms").alias("latency_max_ms"),
    )
    return agg.select(
        F.to_date(F.col("w.start")).alias("date"),
        F.col("w.start").alias("minute"),
        "region",
        "messages",
        "devices",
        F.col("p")[0].alias("latency_p50_ms"),
        F.col("p")[1].alias("latency_p95_ms"),
        F.col("p")[2].alias("latency_p99_ms"),
        "latency_max_ms",
    )
