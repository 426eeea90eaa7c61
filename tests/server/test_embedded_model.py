"""The default deployment: `kubeinfer serve` on the embedded SmolLM2-135M-Instruct answers
chat through the official client with its real chat template and EOS handling."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(start_server):
    with start_server("embedded", max_num_seqs=4, kv_cache_memory=64 * 2**20) as (url, state):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), state


def test_chat_answers_and_stops_at_end_of_turn(client) -> None:
    openai_client, state = client
    model = openai_client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct"
    kwargs = dict(model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
                  max_tokens=48, temperature=0)
    answer = openai_client.chat.completions.create(**kwargs)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and "Paris" in choice.message.content
    assert "<|im_end|>" not in choice.message.content
    chunks = list(openai_client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert state.engine.stats().num_running == 0
