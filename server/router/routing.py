"""The parts of a prefix-aware router that live as long as its app: the routing keys, the
engines' views, polled in the background, and the warm-up of engines that become Ready with
the prefixes the keys showed hot (`warmup.py`).

Without a `--tokenizer`, the tokenizer comes from the first Ready engine's `/tokenizer_info`;
until one answers, requests carry no key and go to the least-loaded replica.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Mapping

from ..model.tokenizer.tokenizer import Tokenizer
from .backends import Backends
from .engine_views import EngineViews
from .routing_key import KeyMaker, RoutingKey
from .warmup import Warmer

log = logging.getLogger(__name__)
KEYED_PATHS = ("v1/chat/completions", "v1/completions")


class Routing:
    def __init__(self, views: EngineViews, tokenizer: Tokenizer | None = None, block_size: int = 16,
                 prefix_key_tokens: int = 256, keyed: bool = True, tokenizer_retry: float = 2.0,
                 warmer: Warmer | None = None) -> None:
        """`keyed`: strategies that read no routing key (least-load, round-robin) skip the tokenizer.
        `warmer`: records the keys' prefixes and warms engines that become Ready with them."""
        self.views, self.prefix_key_tokens, self.tokenizer_retry = views, prefix_key_tokens, tokenizer_retry
        self.keyed, self.warmer = keyed, warmer
        self.keys = KeyMaker(tokenizer, block_size, prefix_key_tokens, views.hasher) if tokenizer else None
        self.background: list[Callable[[], Awaitable[None]]] = []   # more loops for the app's lifetime
        self._tasks: list[asyncio.Task] = []

    def reads_body(self, path: str) -> bool:
        """The picker needs this request's body (its prompt); any other body streams through."""
        return self.keyed and path.strip("/") in KEYED_PATHS

    def key(self, path: str, body: bytes, headers: Mapping[str, str]) -> RoutingKey | None:
        if self.keys is None or path.strip("/") not in KEYED_PATHS:
            return None
        key = self.keys.make(path, body, headers, self.views.adapters())
        if key is not None and self.warmer is not None:
            self.warmer.hot.observe(key)
        return key

    async def start(self, backends: Backends) -> None:
        warmer = self.warmer

        async def ready() -> list[str]:
            urls = await backends.ready()
            if warmer is not None:
                warmer.notice(urls)
            return urls

        self._tasks.append(asyncio.create_task(self.views.run(ready)))
        self._tasks += [asyncio.create_task(loop()) for loop in self.background]
        if self.keys is None and self.keyed:
            self._tasks.append(asyncio.create_task(self._learn_tokenizer(backends)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.warmer is not None:
            await self.warmer.stop()

    async def _learn_tokenizer(self, backends: Backends) -> None:
        while self.keys is None:
            try:
                found = await self.views.fetch_tokenizer(await backends.ready())
            except Exception as error:  # noqa: BLE001 - keep trying: routing works without keys
                log.warning("could not fetch the tokenizer: %s", error)
                found = None
            if found is not None:
                tokenizer, block_size = found
                self.keys = KeyMaker(tokenizer, block_size, self.prefix_key_tokens, self.views.hasher)
                log.info("routing keys from the engines' tokenizer (block size %d)", block_size)
                return
            await asyncio.sleep(self.tokenizer_retry)
