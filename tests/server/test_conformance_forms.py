"""The conformance suite reads KV events in both of vLLM's msgpack forms: tagged arrays (vLLM's
array_like events, which kubeinfer publishes) and maps tagged by "type" (vLLM 0.32's)."""

from __future__ import annotations

import pytest

from e2e.conformance import Failed, kv_event

pytestmark = pytest.mark.unit


def test_array_and_map_events_read_alike() -> None:
    array = ["BlockStored", [11, 12], None, [1, 2, 3], 16, None, "GPU", None]
    mapped = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": [1, 2, 3],
              "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    assert kv_event(array) == kv_event(mapped) == (
        "BlockStored", {"block_hashes": [11, 12], "parent_block_hash": None, "token_ids": [1, 2, 3], "block_size": 16})
    assert kv_event(["AllBlocksCleared"]) == kv_event({"type": "AllBlocksCleared"}) == ("AllBlocksCleared", {})


@pytest.mark.parametrize("event", [["BlockStored", [1]], {"type": "BlockStored", "block_hashes": [1]}, [], 7])
def test_a_truncated_or_foreign_event_fails_the_item(event: object) -> None:
    with pytest.raises(Failed):
        kv_event(event)
