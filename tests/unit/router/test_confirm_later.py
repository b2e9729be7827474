"""Table writes collected under confirm_later (router/stores.py) when the block fails."""

from __future__ import annotations

import asyncio
import gc
import inspect
import warnings

import pytest

from router.stores import KafkaTable, confirm_later


class _StoredAtOnce:
    """A producer whose every write Kafka has confirmed."""

    def send_soon(self, topic, value, key):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def test_confirmations_collected_in_a_block_that_fails_are_closed_not_left_unawaited():
    """The input whose handling failed is requeued and handled again: its collected Kafka
    confirmations are never awaited, and must not warn so (seen in a router's log each time a
    backend node died)."""
    collected = []

    async def scenario():
        table = KafkaTable("127.0.0.1:1", "unit", _StoredAtOnce(), "unit")  # type: ignore[arg-type]  # never started
        with pytest.raises(RuntimeError):
            async with confirm_later() as pending:
                await table.put("d1", b"v")
                collected.extend(pending)
                raise RuntimeError("handling the input failed")
        assert table.data.get("d1") == b"v", "the view changed at once, as without the failure"

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        asyncio.run(scenario())
        gc.collect()
    assert len(collected) == 1 and inspect.getcoroutinestate(collected[0]) == inspect.CORO_CLOSED
    assert not [w for w in seen if "never awaited" in str(w.message)], [str(w.message) for w in seen]
