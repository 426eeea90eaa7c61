"""Workloads for `kubeinfer bench serve`, seeded so every engine sees the same requests.

Prompts are token ids by default (exact lengths on any server with the model's tokenizer;
vLLM, llama.cpp and kubeinfer accept token-id prompts on /v1/completions) or word text
(about one token per word on BPE vocabularies) for servers that only take text.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Short, common English words: one token each (with the leading space) in GPT-2-style BPEs.
_WORDS = ("the of and to in is was for on are as with his they at be this from have or by one had "
          "not but what all were when we there can an your which their said if do will each about how "
          "up out them then she many some so these would other into has more her two like him see time "
          "could no make than first been its who now people my made over did down only way find use may "
          "water long little very after words called just where most know get through back much go good "
          "new write our me man too any day same right look think also around another came come work "
          "three word must because does part even place well such here take why things help put years "
          "different away again off went old number great tell men say small every found still between "
          "name should home big give air line set own under read last never us left end along while might "
          "next sound below saw something thought both few those always looked show large often together").split()


@dataclass
class BenchRequest:
    prompt: str | list[int] | None       # /v1/completions input
    messages: list[dict[str, str]] | None  # /v1/chat/completions input
    prompt_len: int                        # intended input tokens (the server's usage is authoritative)
    output_len: int

    def body(self, model: str, ignore_eos: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": self.output_len, "stream": True,
                                "stream_options": {"include_usage": True}, "temperature": 0.0}
        if ignore_eos:
            body.update(ignore_eos=True, min_tokens=self.output_len)
        body.update({"messages": self.messages} if self.messages is not None else {"prompt": self.prompt})
        return body


@dataclass
class DatasetConfig:
    name: str = "random"             # random | shared-prefix | chat
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    prompt_format: str = "tokens"    # tokens | text
    token_low: int = 1000            # token ids are drawn from [token_low, token_high): no specials
    token_high: int = 20000
    num_groups: int = 4              # shared-prefix: groups x prompts per group
    prefix_len: int = 512
    seed: int | str = 0              # random.Random's seed: a str is hashed the same in every process
    corpus: str = "benchmarks/corpus"  # grounded: folder of .txt passages


def _random_prompt(rng: random.Random, length: int, config: DatasetConfig) -> str | list[int]:
    if config.prompt_format == "tokens":
        return [rng.randrange(config.token_low, config.token_high) for _ in range(length)]
    return " ".join(rng.choice(_WORDS) for _ in range(length))


def _join(prefix: str | list[int], rest: str | list[int]) -> str | list[int]:
    return prefix + rest if isinstance(prefix, list) else f"{prefix} {rest}"  # type: ignore[operator]


def _chat_mix(rng: random.Random, config: DatasetConfig) -> list[BenchRequest]:
    """Chat-shaped traffic: a few turns of varied length, short-to-medium answers."""
    requests = []
    for _ in range(config.num_prompts):
        turns = rng.choice((1, 1, 2, 3))
        messages = [{"role": "system", "content": "You are a helpful assistant."}]
        for turn in range(turns):
            length = max(4, int(rng.lognormvariate(3.5, 0.8)))
            messages.append({"role": "user", "content": " ".join(rng.choice(_WORDS) for _ in range(length))})
            if turn < turns - 1:
                messages.append({"role": "assistant", "content": " ".join(rng.choices(_WORDS, k=length))})
        words = sum(len(m["content"].split()) for m in messages)
        output = max(8, min(config.output_len * 2, int(rng.lognormvariate(4.0, 0.7))))
        requests.append(BenchRequest(None, messages, words, output))
    return requests


_GROUNDED_TASKS = (
    "Repeat the text above word for word.",
    "Copy the first paragraph of the text above exactly.",
    "Rewrite the text above, replacing every '{word}' with '{other}'. Change nothing else.",
    "List every sentence of the text above that contains the word '{word}', copied exactly, one per line.",
    "Summarise the text above, quoting its key sentences word for word.",
)


def _grounded(rng: random.Random, config: DatasetConfig) -> list[BenchRequest]:
    """Input-grounded chat: a passage of the corpus, then a task whose answer copies from it
    (repeat, rewrite, extract, summarise), as in retrieval, editing and extraction traffic."""
    paths = sorted(Path(config.corpus).glob("*.txt"))
    if not paths:
        raise ValueError(f"no .txt passages in --corpus {config.corpus!r}")
    passages = [path.read_text().strip() for path in paths]
    requests = []
    for _ in range(config.num_prompts):
        passage = rng.choice(passages)
        words = sorted({w for w in re.findall(r"[a-z]{5,}", passage.lower())})
        word, other = rng.choice(words), rng.choice(_WORDS)
        task = rng.choice(_GROUNDED_TASKS).format(word=word, other=other)
        content = f"{passage}\n\n{task}"
        requests.append(BenchRequest(None, [{"role": "user", "content": content}], len(content.split()),
                                     config.output_len))
    return requests


def build_dataset(config: DatasetConfig) -> list[BenchRequest]:
    rng = random.Random(config.seed)
    if config.name == "random":
        return [BenchRequest(_random_prompt(rng, config.input_len, config), None, config.input_len,
                             config.output_len) for _ in range(config.num_prompts)]
    if config.name == "shared-prefix":
        per_group = max(1, config.num_prompts // config.num_groups)
        requests = []
        for _ in range(config.num_groups):
            prefix = _random_prompt(rng, config.prefix_len, config)
            requests += [BenchRequest(_join(prefix, _random_prompt(rng, config.input_len, config)), None,
                                      config.prefix_len + config.input_len, config.output_len)
                         for _ in range(per_group)]
        rng.shuffle(requests)  # groups interleave, as concurrent users of a few system prompts do
        return requests
    if config.name == "chat":
        return _chat_mix(rng, config)
    if config.name == "grounded":
        return _grounded(rng, config)
    raise ValueError(f"unknown dataset {config.name!r} (random, shared-prefix, chat, grounded)")
