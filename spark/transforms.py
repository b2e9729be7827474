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
    return parsed.where("reject_reason IS NULL").selectExpr(*_RAW_SELECT)


def raw_rows(decoded: DataFrame) -> DataFrame:
    """Decoded records (decode_kafka) -> telemetry_raw rows."""
    return accepted_rows(parse(decoded))


def reject_rows(decoded: DataFrame) -> DataFrame:
    return decoded.where("reject_reason IS NOT NULL").selectExpr(*_REJECT_SELECT)


# What a micro-batch selects, as SQL the JVM parses: each column built from Python would
# cost the job's batch several calls into the JVM (the function's lookup by name among
# PySpark's imported packages, the member, the call), ~3 per column, every 2 s.
_RAW_SELECT = tuple(f"`{c}`" for c in RAW_COLUMNS)
_REJECT_SELECT = (
    "kafka_topic",
    "kafka_partition",
    "kafka_offset",
    "kafka_ts",
    "mqtt_topic",
    "region",
    "device",
    "reject_reason AS reason",
    "payload_bytes",
    "substring(coalesce(payload, ''), 1, 200) AS payload_preview",
    "to_date(kafka_ts) AS date",
)


#: A minute's latencies are kept as a histogram, so that the percentiles of two batches'
#: readings can be computed from their own histograms added up (the aggregates count each
#: batch's rows into the stored minutes: spark/tables.py).  A latency under this many ms is
#: its own bucket (exact); above, buckets grow by LATENCY_BUCKET_RATIO: a percentile read
#: from its bucket is within half a percent of the true value.
EXACT_LATENCY_MS = 100
LATENCY_BUCKET_RATIO = 1.01
#: Distinct devices per region and minute: a HyperLogLog sketch of 2^12 registers (1.6 %
#: relative error; exact for small counts), kept so that batches' sketches add up.
DEVICES_SKETCH_LG_K = 12


def latency_bucket(latency_ms: str) -> str:
    """SQL: the histogram bucket of a latency (ms, negative for a clock a little ahead)."""
    x, lo, ratio = latency_ms, EXACT_LATENCY_MS, LATENCY_BUCKET_RATIO
    return (
        f"CAST(CASE WHEN abs({x}) < {lo} THEN {x} "
        f"ELSE signum({x}) * ({lo} + floor(ln(abs({x}) / {lo}.0) / ln({ratio}))) END AS INT)"
    )


def bucket_latency(bucket: str) -> str:
    """SQL: the latency (ms) a bucket stands for: itself under EXACT_LATENCY_MS, else the
    middle of its range (in ratio)."""
    b, lo, ratio = bucket, EXACT_LATENCY_MS, LATENCY_BUCKET_RATIO
    return (
        f"CAST(CASE WHEN abs({b}) < {lo} THEN {b} "
        f"ELSE signum({b}) * round({lo} * power({ratio}, abs({b}) - {lo} + 0.5)) END AS BIGINT)"
    )


def histogram_percentile(histogram: str, q: str) -> str:
    """SQL: the `q` percentile (a decimal literal, e.g. '0.95') of a latency histogram (map of
    bucket -> count): the latency of the first bucket by which q of the counts are reached,
    as percentile_approx picks the smallest value with q of the values at or below it.
    NULL for an empty histogram."""
    entries = f"array_sort(map_entries({histogram}))"  # by bucket: struct order is key first
    rank = f"ceil({q} * aggregate(map_values({histogram}), 0L, (n, c) -> n + c))"
    walk = (
        f"aggregate({entries}, named_struct('n', 0L, 'rank', {rank}, 'b', CAST(NULL AS INT)), "
        "(a, e) -> named_struct('n', a.n + e.value, 'rank', a.rank, "
        "'b', coalesce(a.b, CASE WHEN a.n + e.value >= a.rank THEN e.key END)), a -> a.b)"
    )
    return bucket_latency(walk)


def add_histograms(a: str, b: str) -> str:
    return f"map_zip_with({a}, {b}, (k, x, y) -> coalesce(x, 0L) + coalesce(y, 0L))"


def device_minute(raw: DataFrame) -> DataFrame:
    """Per device and minute (of event time): for each numeric field count,
    min, max, avg and the last value; the row with field '*' counts all the
    device's messages of that minute.

    With them the states that let a later batch's rows of the same minute be added
    (DEVICE_MINUTE_MERGE): the sum, the time of the last value, and `counted_through`,
    the last micro-batch (`ingest_batch`) whose rows the row counts."""
    entries = F.concat(
        F.array(
            F.struct(F.lit(ALL_MESSAGES_FIELD).alias("field"), F.lit(None).cast("double").alias("value"))
        ),
        F.transform(
            F.map_entries("numeric_fields"),
            lambda e: F.struct(e["key"].alias("field"), e["value"].alias("value")),
        ),
    )
    # The region of the last reading is aggregated as a number, its name's hash, and named
    # again from the rows' few (hash, name) pairs: an aggregate of a string value makes
    # Spark sort every exploded row instead of hashing them (300,000 readings: 1.29 ->
    # 0.84-1.03 s, docs/benchmarks.md).  Region names are the operators' own
    # (contract.validate_region), a handful per minute: a collision of their 64-bit
    # hashes keeps one of the two names.
    region_code = F.xxhash64("region").alias("region_code")
    exploded = raw.select(
        "device", region_code, "event_time", "ingest_batch", F.explode(entries).alias("e")
    ).select("device", "region_code", "event_time", "ingest_batch", "e.field", "e.value")
    agg = exploded.groupBy(F.window("event_time", "1 minute").alias("w"), "device", "field").agg(
        F.count(F.lit(1)).alias("count"),
        F.min("value").alias("min"),
        F.max("value").alias("max"),
        F.sum("value").alias("sum"),
        F.max_by("value", "event_time").alias("last"),
        F.max_by("region_code", "event_time").alias("region_code"),
        F.max("event_time").alias("last_at"),
        F.max("ingest_batch").alias("counted_through"),
    )
    # the distinct pairs by hashing first: dropping a hash's duplicates keeps a string, which
    # sorts, so it runs on those few pairs only
    names = raw.select(region_code, "region").distinct().dropDuplicates(["region_code"])
    agg = agg.join(F.broadcast(names), "region_code")
    return agg.select(
        F.to_date(F.col("w.start")).alias("date"),
        F.col("w.start").alias("minute"),
        "device",
        "region",
        "field",
        "count",
        "min",
        "max",
        (F.col("sum") / F.col("count")).alias("avg"),
        "last",
        "sum",
        "last_at",
        "counted_through",
    )


def region_minute(raw: DataFrame) -> DataFrame:
    """Per region and minute (of event time): messages, distinct devices and
    end-to-end latency (device send -> Kafka) percentiles.

    With them the states that let a later batch's rows of the same minute be added
    (REGION_MINUTE_MERGE): the devices' sketch, the latency histogram and `counted_through`.
    Two steps: per latency bucket, then per minute -- the histogram is the second's list
    of the first's counts."""
    w = F.window("event_time", "1 minute").alias("w")
    per_bucket = raw.groupBy(w, "region", F.expr(latency_bucket("latency_ms")).alias("bucket")).agg(
        F.count(F.lit(1)).alias("messages"),
        F.count("latency_ms").alias("timed"),
        F.hll_sketch_agg("device", DEVICES_SKETCH_LG_K).alias("sketch"),
        F.max("latency_ms").alias("latency_max_ms"),
        F.max("ingest_batch").alias("counted_through"),
    )
    agg = per_bucket.groupBy("w", "region").agg(
        F.sum("messages").alias("messages"),
        F.hll_union_agg("sketch").alias("devices_sketch"),
        F.map_from_entries(
            F.collect_list(F.when(F.col("timed") > 0, F.struct(F.col("bucket"), F.col("timed"))))
        ).alias("latency_histogram"),
        F.max("latency_max_ms").alias("latency_max_ms"),
        F.max("counted_through").alias("counted_through"),
    )
    return agg.select(
        F.to_date(F.col("w.start")).alias("date"),
        F.col("w.start").alias("minute"),
        "region",
        "messages",
        F.hll_sketch_estimate("devices_sketch").alias("devices"),
        *(
            F.expr(histogram_percentile("latency_histogram", q)).alias(f"latency_p{name}_ms")
            for name, q in LATENCY_PERCENTILES
        ),
        "latency_max_ms",
        "devices_sketch",
        "latency_histogram",
        "counted_through",
    )


LATENCY_PERCENTILES = (("50", "0.50"), ("95", "0.95"), ("99", "0.99"))


def _newer(column: str) -> str:
    """SQL for a MERGE's update: the column of the source row `s` if its last value is at
    least as recent as the target row `t`'s."""
    return f"CASE WHEN s.last_at >= t.last_at THEN s.{column} ELSE t.{column} END"


_SUM = "coalesce(t.sum + s.sum, t.sum, s.sum)"
#: How a stored device_minute row `t` and one of new rows `s` (same minute, device, field)
#: become the row of both: SQL per column, for a MERGE's `UPDATE SET`.
DEVICE_MINUTE_MERGE = {
    "count": "t.count + s.count",
    "min": "least(t.min, s.min)",
    "max": "greatest(t.max, s.max)",
    "avg": f"{_SUM} / (t.count + s.count)",
    "last": _newer("last"),
    "sum": _SUM,
    "region": _newer("region"),
    "last_at": "greatest(t.last_at, s.last_at)",
    "counted_through": "greatest(t.counted_through, s.counted_through)",
}
_HISTOGRAM = add_histograms("t.latency_histogram", "s.latency_histogram")
_SKETCH = "hll_union(t.devices_sketch, s.devices_sketch)"
#: The same for region_minute (same minute, region).
REGION_MINUTE_MERGE = {
    "messages": "t.messages + s.messages",
    "devices_sketch": _SKETCH,
    "devices": f"hll_sketch_estimate({_SKETCH})",
    "latency_histogram": _HISTOGRAM,
    **{f"latency_p{name}_ms": histogram_percentile(_HISTOGRAM, q) for name, q in LATENCY_PERCENTILES},
    "latency_max_ms": "greatest(t.latency_max_ms, s.latency_max_ms)",
    "counted_through": "greatest(t.counted_through, s.counted_through)",
}
