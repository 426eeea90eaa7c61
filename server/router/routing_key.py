"""What a routing strategy knows about a request: its prompt's block hashes and its session.

The prompt is tokenized exactly as the engine will (the engine's own `Tokenizer`, chat
template included, and its request models), and hashed with the engine's block-hash chain
(`kubeinfer.server.engine.kv_events`, keyed with the service's secret), so a hash found in an engine's `/kv/blocks` means that
engine holds this prompt's KV up to that block. Torch-free.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Sequence

import pydantic

from ..api.protocol import ChatCompletionRequest, CompletionRequest
from ..engine.kv_events import UNKEYED, BlockHasher
from ..model.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)
SESSION_HEADER = "x-session-id"


@dataclass(frozen=True)
class RoutingKey:
    """`hashes`: the full blocks the engine could find cached (all tokens but the last, whose
    logits it always computes). `affinity`: a hash of the first `prefix_key_tokens` tokens that
    picks a replica when none has the prefix, so requests sharing their start meet there."""

    num_tokens: int
    block_size: int
    hashes: tuple[int, ...]
    affinity: int
    session: str | None = None
    adapter: str | None = None   # the LoRA adapter the request names as its model
    # the cache namespace and the prompt, for warming new replicas (warmup.py)
    model: str | None = None
    salt: str | None = None
    tokens: Sequence[int] = field(default=(), repr=False, compare=False)


def session_of(body: Mapping[str, Any] | None, headers: Mapping[str, str]) -> str | None:
    """`x-session-id`, else OpenAI's `user` field."""
    session = headers.get(SESSION_HEADER)
    if session:
        return session
    user = (body or {}).get("user")
    return user if isinstance(user, str) and user else None


class KeyMaker:
    """Builds routing keys with the model's tokenizer; `None` where the engine would refuse the
    body (it answers that itself) or nothing routes by prefix (other paths)."""

    def __init__(self, tokenizer: Tokenizer, block_size: int, prefix_key_tokens: int = 256,
                 hasher: BlockHasher = UNKEYED) -> None:
        self.tokenizer, self.block_size = tokenizer, block_size
        self.prefix_key_tokens, self.hasher = prefix_key_tokens, hasher

    def prompt_ids(self, path: str, body: Mapping[str, Any]) -> tuple[list[int], str | None, str | None] | None:
        """(prompt token ids, cache_salt, model) of the request's first prompt."""
        if path.endswith("chat/completions"):
            chat = ChatCompletionRequest.model_validate(body)
            ids = self.tokenizer.encode_chat([m.to_template() for m in chat.messages],
                                             chat.add_generation_prompt, chat.continue_final_message,
                                             chat.chat_template_kwargs)
            return ids, chat.cache_salt, chat.model
        if path.endswith("completions"):
            completion = CompletionRequest.model_validate(body)
            prompt = completion.prompt
            first = prompt[0] if isinstance(prompt, list) and not isinstance(prompt[0], int) else prompt
            ids = self.tokenizer.encode(first) if isinstance(first, str) else [int(t) for t in first]
            return ids, completion.cache_salt, completion.model
        return None

    def make(self, path: str, body: bytes, headers: Mapping[str, str],
             adapters: Collection[str] = ()) -> RoutingKey | None:
        """`adapters`: the LoRA adapter names the engines hold; a request whose model is one is
        hashed in that adapter's namespace, as the engine hashes its blocks."""
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            return None
        session = session_of(parsed if isinstance(parsed, dict) else None, headers)
        if not isinstance(parsed, dict):
            return None
        try:
            found = self.prompt_ids(path, parsed)
        except (pydantic.ValidationError, ValueError, TypeError, IndexError) as error:
            log.debug("no routing key for %s: %s", path, error)
            return None
        if found is None or not found[0]:
            return None
        ids, salt, model = found
        adapter = model if model in adapters else None
        hashes = tuple(self.hasher.prompt(ids[:-1], self.block_size, salt, adapter))
        affinity = self.hasher.block(self.hasher.root(salt, adapter), ids[:self.prefix_key_tokens])
        return RoutingKey(len(ids), self.block_size, hashes, affinity, session, adapter,
                          model if isinstance(model, str) else None, salt, ids)
