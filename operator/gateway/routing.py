"""The parts of a prefix-aware router that live as long as its app: the routing keys and the
engines' views, polled in the background.

Without a `--tokenizer`, the tokenizer comes from the first Ready engine's `/tokenizer_info`;
until one answers, requests carry no key and go to the least-loaded replica.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Mapping

from kubeinfer.server.model.tokenizer import Tokenizer
from .backends import Backends
from .engine_views import EngineViews
from .routing_key import KeyMaker, RoutingKey

log = logging.getLogger(__name__)
KEYED_PATHS = ("v1/chat/completions", "v1/completions")


class Routing:
    def __init__(self, views: EngineViews, tokenizer: Tokenizer | None = None, block_size: int = 16,
                 prefix_key_tokens: int = 256, keyed: bool = True, tokenizer_retry: float = 2.0) -> None:
        """`keyed`: strategies that read no routing key (least-load, round-robin) skip the tokenizer."""
        self.views, self.prefix_key_tokens, self.tokenizer_retry = views, prefix_key_tokens, tokenizer_retry
        self.keyed = keyed
        self.keys = KeyMaker(tokenizer, block_size, prefix_key_tokens) if tokenizer else None
        self.background: list[Callable[[], Awaitable[None]]] = []   # more loops for the app's lifetime
        self._tasks: list[asyncio.Task] = []

    def key(self, path: str, body: bytes, headers: Mapping[str, str]) -> RoutingKey | None:
        if self.keys is None or path.strip("/") not in KEYED_PATHS:
            return None
        return self.keys.make(path, body, headers, self.views.adapters())

    async def start(self, backends: Backends) -> None:
        self._tasks.append(asyncio.create_task(self.views.run(backends.ready)))
        self._tasks += [asyncio.create_task(loop()) for loop in self.background]
        if self.keys is None and self.keyed:
            self._tasks.append(asyncio.create_task(self._learn_tokenizer(backends)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _learn_tokenizer(self, backends: Backends) -> None:
        while self.keys is None:
            try:
                found = await self.views.fetch_tokenizer(await backends.ready())
            except Exception as error:  # noqa: BLE001 - keep trying: routing works without keys
                log.warning("could not fetch the tokenizer: %s", error)
                found = None
            if found is not None:
                tokenizer, block_size = found
                self.keys = KeyMaker(tokenizer, block_size, self.prefix_key_tokens)
                log.info("routing keys from the engines' tokenizer (block size %d)", block_size)
                return
            await asyncio.sleep(self.tokenizer_retry)
