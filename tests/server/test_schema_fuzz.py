"""schemathesis over the server's own OpenAPI schema on the embedded model (issue 28): every
POST endpoint, bodies that follow the schema and bodies that break it, numbers unrestricted
(no hook narrows a float or an int). No answer may be a 5xx and the engine must live on.

`KUBEINFER_FUZZ_EXAMPLES` raises the number of requests for a longer run by hand
(docs/engine.md, "Reliability"); the default keeps `make test` at about a minute on 2 vCPUs.
`KUBEINFER_FUZZ_MODEL=tiny` fuzzes the tiny random test model instead (same server, ~50x less
compute a token), for long runs on a busy machine.
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("KUBEINFER_FUZZ_EXAMPLES", "100"))
# A short context bounds the work any one generated request can ask for (n x max_tokens);
# it is a server setting, the generated values themselves are not narrowed.
CONTEXT = 64


@pytest.fixture(scope="module")
def server(start_server, request):
    model = os.environ.get("KUBEINFER_FUZZ_MODEL", "embedded")
    if model == "tiny":
        model = request.getfixturevalue("tiny_model_path")
    with start_server(model, max_num_seqs=32, max_model_len=CONTEXT, kv_cache_memory=128 * 2**20) as served:
        yield served


def test_fuzzed_requests_get_no_5xx_and_leave_the_engine_alive(server) -> None:
    url, state = server
    schema = schemathesis.openapi.from_url(url + "/openapi.json").include(method="POST")
    assert {operation.ok().path for operation in schema.get_all_operations()} == {
        "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"}
    cases = st.one_of(schema.as_strategy(generation_mode=mode)
                      for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE))
    statuses: dict[int, int] = {}
    server_errors: list[str] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def send(case) -> None:
        response = case.call(base_url=url, timeout=600)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            server_errors.append(f"{response.status_code} {case.operation.label} {case.body!r:.300}: "
                                 f"{response.text[:300]}")

    send()
    print(f"schemathesis: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
    assert not server_errors, "\n".join(server_errors)
    assert sum(statuses.values()) >= EXAMPLES and state.engine.is_alive(), statuses
    for probe in ("/health", "/ready"):
        assert httpx.get(url + probe).status_code == 200
    plain = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert plain.status_code == 200
