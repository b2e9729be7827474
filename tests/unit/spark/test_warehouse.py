"""Exactly-once landing of micro-batches and the recompute's partition overwrite, on a local folder."""

from __future__ import annotations

import datetime as dt

import pytest

from spark.tables import DEVICE_MINUTE, REGION_MINUTE, Warehouse, read_table, schemas

pytestmark = pytest.mark.spark

DAY1, DAY2 = dt.date(2026, 11, 21), dt.date(2026, 11, 22)


def region_rows(spark, rows):
    """region_minute rows: (date, region, messages)."""
    schema = schemas(spark)[REGION_MINUTE.name]  # date, minute, region, messages, devices, latencies
    full = [(d, dt.datetime.combine(d, dt.time(10)), region, n, 1, 2, 3, 4, 5) for d, region, n in rows]
    return spark.createDataFrame(full, schema)


def messages(spark, wh):
    return sorted(
        (r["date"], r["region"], r["messages"]) for r in read_table(spark, wh, REGION_MINUTE).collect()
    )


def test_a_replayed_batch_lands_once_and_is_not_even_built(spark, tmp_path):
    wh = Warehouse(spark, str(tmp_path))
    built = []

    def build():
        built.append(1)
        return [(REGION_MINUTE, region_rows(spark, [(DAY1, "local-eu", 5)]))], {"rows": 1}

    assert wh.land("q", 0, build) is True
    assert wh.land("q", 0, build) is False, "the replay of a committed batch writes nothing"
    assert len(built) == 1
    assert messages(spark, wh) == [(DAY1, "local-eu", 5)]


def test_a_batch_that_died_half_way_is_redone_without_its_partial_files(spark, tmp_path, monkeypatch):
    wh = Warehouse(spark, str(tmp_path))
    frame = region_rows(spark, [(DAY1, "local-eu", 5), (DAY2, "local-us", 7)])
    batch = lambda: ([(REGION_MINUTE, frame)], {"rows": 2})  # noqa: E731
    move_all = wh._move

    def killed_after_one_file(moves):
        move_all(moves[:1])
        raise RuntimeError("killed mid-move")

    # the dead attempt: one of its two files moved in, its marker never written
    monkeypatch.setattr(wh, "_move", killed_after_one_file)
    with pytest.raises(RuntimeError):
        wh.land("q", 3, batch)
    assert len(messages(spark, wh)) == 1, "the dead attempt left half a batch in the table"
    assert not wh.committed("q", 3)

    monkeypatch.setattr(wh, "_move", move_all)
    assert wh.land("q", 3, batch) is True
    assert messages(spark, wh) == [(DAY1, "local-eu", 5), (DAY2, "local-us", 7)], "no row twice"
    assert sorted(f.name for f in (tmp_path / "_commits" / "q").iterdir() if not f.name.startswith(".")) == [
        "000000000003"
    ], "the list of files in flight is gone once the batch committed"


def test_a_batch_that_died_writing_its_move_list_is_redone(spark, tmp_path):
    wh = Warehouse(spark, str(tmp_path))
    (tmp_path / "_commits" / "q").mkdir(parents=True)
    (tmp_path / "_commits" / "q" / "000000000004.moving").write_text('{"files": ["')  # cut short
    frame = region_rows(spark, [(DAY1, "local-eu", 5)])
    assert wh.land("q", 4, lambda: ([(REGION_MINUTE, frame)], {"rows": 1})) is True
    assert messages(spark, wh) == [(DAY1, "local-eu", 5)]


def test_overwrite_dates_replaces_those_dates_and_keeps_the_others(spark, tmp_path):
    wh = Warehouse(spark, str(tmp_path))
    first = region_rows(spark, [(DAY1, "local-eu", 5), (DAY2, "local-eu", 7)])
    wh.land("q", 0, lambda: ([(REGION_MINUTE, first)], {}))
    wh.overwrite_dates(REGION_MINUTE, region_rows(spark, [(DAY2, "local-eu", 9)]), [str(DAY2)], "recompute-1")
    assert messages(spark, wh) == [(DAY1, "local-eu", 5), (DAY2, "local-eu", 9)]
    assert read_table(spark, wh, DEVICE_MINUTE).count() == 0, "a table never written reads as empty"
