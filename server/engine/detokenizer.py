"""Incremental detokenization that streams valid UTF-8 only and never leaks a stop string.

Each step decodes a short window of ids (vLLM's prefix/read offsets) instead of the whole
output, and holds text back while it ends in a replacement char (an incomplete UTF-8
sequence) or in a prefix of a stop string.
"""

from __future__ import annotations

from typing import Protocol, Sequence

_PROMPT_CONTEXT = 6  # prompt tokens kept so the first output token decodes with its spacing


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False
                 ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop_str_in_output
        self.ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all decoded output text (cut at a stop string)
        self.num_sent_chars = 0

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Decode one more token; returns the stop string it completed, if any (stop strings
        are not looked for while `check_stop` is False, e.g. before min_tokens)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # nothing printable yet: wait for the rest of the character
        searched_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._cut_at_stop(searched_from) if check_stop else None

    def _cut_at_stop(self, start: int) -> str | None:
        found: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.text.find(stop, start)
            if index != -1 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return None
        index, stop = found
        self.text = self.text[:index + (len(stop) if self.include_stop else 0)]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, hold back a possible stop-string prefix."""
        end = len(self.text)
        if not finished and not self.include_stop:
            end -= self._held_back()
        end = max(end, self.num_sent_chars)
        delta = self.text[self.num_sent_chars:end]
        self.num_sent_chars = end
        return delta

    @property
    def sent_text(self) -> str:
        return self.text[:self.num_sent_chars]

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
