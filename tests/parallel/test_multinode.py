"""Ranks on other "nodes": separate `kubeinfer serve --headless` processes that share only the
master's address and port (vLLM's --nnodes / --node-rank / --master-addr / --master-port).

Tensor parallelism across two processes and pipeline parallelism across two processes give the
single-process greedy tokens and logprobs; a pipelined step of 8 sequences gives what one
sequence at a time gives; the leader is ready only once the other node joined and loaded, and a
killed node takes it down at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable, Iterator

import httpx
import pytest

from helpers.serve_process import free_port, wait_until_ready
from helpers.tiny_models import make_tiny_llama
from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.flags import to_args
from parity import assert_greedy_parity
from test_tp_parity import ENGINE, GREEDY, random_prompts

pytestmark = pytest.mark.integration

SERVE = [sys.executable, "-m", "kubeinfer.server.cli", "serve"]
EXACT = dict(tie_gap=1e-4, logprob=1e-4)
SMOL_ENGINE = dict(dtype="float32", device="cpu", max_num_batched_tokens=32, kv_cache_memory=16 << 20)


def _node_args(model: str, node_rank: int, port: int, tensor: int, pipeline: int) -> list[str]:
    return ["--model", model, "--dtype", "float32", "--device", "cpu", "--tensor-parallel-size", str(tensor),
            "--pipeline-parallel-size", str(pipeline), "--nnodes", "2", "--node-rank", str(node_rank),
            "--master-addr", "127.0.0.1", "--master-port", str(port)]


def _start_headless(model: str, port: int, tensor: int, pipeline: int, **engine) -> subprocess.Popen:
    """Node 1, started as every node must be: with node 0's engine flags."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = to_args({key: value for key, value in engine.items() if key not in ("dtype", "device")})
    return subprocess.Popen([*SERVE, "--headless", *_node_args(model, 1, port, tensor, pipeline), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.fixture
def two_node_llm(make_tp_llm) -> Iterator[Callable[..., LLM]]:
    """two_node_llm(model, tensor, pipeline, **engine) -> the leader's LLM, its second node a
    headless process; after the test the leader stops both and the headless node exits 0."""
    headless: list[subprocess.Popen] = []

    def make(model: str, tensor: int, pipeline: int, **engine) -> LLM:
        port = free_port()
        headless.append(_start_headless(model, port, tensor, pipeline, **engine))
        return make_tp_llm(model, tensor_parallel_size=tensor, pipeline_parallel_size=pipeline, nnodes=2,
                           master_addr="127.0.0.1", master_port=port, **engine)

    yield make
    from kubeinfer.server.parallel.launch import shutdown_tensor_parallel

    shutdown_tensor_parallel()
    for process in headless:
        code = process.wait(timeout=30)
        assert code == 0, process.stdout.read()


@pytest.mark.parametrize("tensor, pipeline", [pytest.param(2, 1, id="tp2"), pytest.param(1, 2, id="pp2")])
def test_tiny_llama_across_two_processes_matches_one(tensor, pipeline, tmp_path, two_node_llm):
    path = str(make_tiny_llama(tmp_path))
    prompts = random_prompts(8, seed=3)
    reference = LLM(path, **ENGINE).generate(prompts, GREEDY)
    llm = two_node_llm(path, tensor, pipeline, **ENGINE)
    outputs = llm.generate(prompts, GREEDY)
    assert_greedy_parity(outputs, reference, **EXACT)
    if pipeline > 1:   # 8 sequences in micro-batches through the stages, or one at a time
        one_by_one = [llm.generate([prompt], GREEDY)[0] for prompt in prompts]
        assert [o.outputs[0].token_ids for o in one_by_one] == [o.outputs[0].token_ids for o in outputs]
        assert_greedy_parity(one_by_one, outputs, **EXACT)


def test_embedded_model_pp2_across_two_processes_matches_one(two_node_llm):
    """SmolLM2 (30 layers, Q4_1 GGUF): stages 0-14 and 15-29, the tied head on the last stage."""
    reference_llm = LLM("embedded", **SMOL_ENGINE)
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    prompts = [reference_llm.tokenizer.encode(chat.format(q), add_special_tokens=False)
               for q in ("What is the capital of France?", "Name three colours.", "Count to five.")]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
    reference = reference_llm.generate(prompts, params)
    del reference_llm
    outputs = two_node_llm("embedded", 1, 2, **SMOL_ENGINE).generate(prompts, params)
    assert_greedy_parity(outputs, reference, **EXACT)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_leader_ready_only_with_every_node_and_down_at_once_without_one(tmp_path):
    """Also: a node started with other engine flags than node 0's refuses to start its ranks."""
    model, master, port = str(make_tiny_llama(tmp_path)), free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    leader = subprocess.Popen([*SERVE, *_node_args(model, 0, master, 1, 2), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    headless = None
    try:
        line = ""
        while "waiting for 1 ranks on 1 other nodes" not in line:   # rank 0 is up, alone
            line = leader.stdout.readline()
            assert line, "the leader exited before waiting for the other node"
        assert not _healthy(url)
        mismatched = _start_headless(model, master, 1, 2, block_size=32)
        assert mismatched.wait(timeout=60) == 1
        assert "--block-size (node 0: 16, node 1: 32)" in mismatched.stdout.read()
        headless = _start_headless(model, master, 1, 2)
        wait_until_ready(leader, url, timeout=120)
        reply = httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": [5, 6, 7],
                                                         "max_tokens": 4, "temperature": 0}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        headless.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while _healthy(url):
            assert time.monotonic() - killed < 2, "/health still passes 2 s after the other node died"
            time.sleep(0.05)
        assert leader.wait(timeout=15) == 1
        assert "node 1 disconnected" in leader.stdout.read()
    finally:
        for process in (leader, headless):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()


def test_leaders_in_one_network_namespace_share_the_master_port_on_their_own_addresses():
    """Pods of the local cluster share the host's network: each leader's store listens on its own
    address (its --master-addr), so two groups' leaders both use the rendered port."""
    import torch.distributed as dist

    from kubeinfer.server.parallel.group import Topology, host_store

    port = free_port()
    stores = [host_store(Topology(1, 2, 2, address, port)) for address in ("127.0.0.7", "127.0.0.8")]
    for index, (store, address) in enumerate(zip(stores, ("127.0.0.7", "127.0.0.8"))):
        store.set("leader", str(index))
        assert dist.TCPStore(address, port, is_master=False).get("leader") == str(index).encode()
