"""A served engine with `--kv-events-config` publishes, over ZMQ, the blocks its prefix cache
stores for a request: the token ids of the prompt, and the same hashes GET /kv/blocks lists."""

from __future__ import annotations

import msgpack
import pytest
import zmq

from kubeinfer.server.engine.kv_events import HASH_SCHEME

pytestmark = pytest.mark.integration


def test_served_requests_publish_their_blocks(start_server, tiny_model_path, tmp_path):
    endpoint = f"ipc://{tmp_path}/events.sock"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    try:
        with start_server(tiny_model_path, block_size=4, kv_events_config=config) as (url, _):
            import httpx

            prompt = list(range(10, 47))   # 9 full blocks of 4 (the last token is never cached)
            stored: list[list] = []
            with httpx.Client(base_url=url, timeout=60) as client:
                for attempt in range(50):   # PUB drops batches until the subscription has arrived
                    body = {"prompt": [prompt[:4 * (attempt % 4 + 1)] + [attempt, 99, 98, 97, 96]],
                            "max_tokens": 1}
                    assert client.post("/v1/completions", json=body).status_code == 200
                    if poller.poll(200):
                        break
                while poller.poll(200):
                    sub.recv_multipart()
                response = client.post("/v1/completions", json={"prompt": [prompt], "max_tokens": 1})
                assert response.status_code == 200
                while poller.poll(2000):
                    topic, seq, payload = sub.recv_multipart()
                    stored += [e for e in msgpack.unpackb(payload)[1] if e[0] == "BlockStored"]
                    if sum(len(e[1]) for e in stored) >= 9 - 4:
                        break
                digest = client.get("/kv/blocks").json()
            assert topic == b"kv" and digest["hash"] == HASH_SCHEME
            tokens = [t for event in stored for t in event[3]]
            hashes = [h % (1 << 64) for event in stored for h in event[1]]
            assert all(event[4] == 4 and event[6] == "GPU" for event in stored)
            assert prompt[:36][-len(tokens):] == tokens and len(tokens) % 4 == 0 and tokens
            assert set(hashes) <= set(digest["stored"])
    finally:
        sub.close(0)
        context.term()
