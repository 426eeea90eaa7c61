"""The serving tokenizer: a `tokenizers.Tokenizer` plus the model's special tokens and chat template.

Built from a HF directory (tokenizer.json, tokenizer_config.json) or from GGUF metadata; the
engine only sees this class, so both sources behave the same.
"""

from __future__ import annotations

from typing import Any, Sequence

from tokenizers import Tokenizer as BackendTokenizer

from .chat_template import ChatTemplateError, render_chat


class Tokenizer:
    def __init__(self, backend: BackendTokenizer, *, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, eos_token_ids: frozenset[int], extra_special_tokens: dict[str, str | None]
                 | None = None) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        self.eos_token_ids = frozenset(eos_token_ids | ({eos_id} if eos_id is not None else set()))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.all_special_ids = frozenset(
            index for index, token in backend.get_added_tokens_decoder().items() if token.special)
        self._template_tokens = {"bos_token": bos_token, "eos_token": eos_token, **(extra_special_tokens or {})}

    def describe(self) -> dict[str, Any]:
        """Everything a router needs to tokenize prompts exactly as this engine does (JSON-safe;
        served at GET /tokenizer_info): the tokenizer.json, the chat template, its special tokens."""
        return {"tokenizer_json": self.backend.to_str(), "chat_template": self.chat_template,
                "special_tokens": self._template_tokens, "eos_token_ids": sorted(self.eos_token_ids)}

    @classmethod
    def from_description(cls, info: dict[str, Any]) -> "Tokenizer":
        """The inverse of `describe`."""
        special = dict(info.get("special_tokens") or {})
        bos, eos = special.pop("bos_token", None), special.pop("eos_token", None)
        return cls(BackendTokenizer.from_str(info["tokenizer_json"]), chat_template=info.get("chat_template"),
                   bos_token=bos, eos_token=eos, eos_token_ids=frozenset(info.get("eos_token_ids") or ()),
                   extra_special_tokens=special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict | None = None) -> str:
        """A chat request's prompt text, as the server builds it. `template_kwargs` (vLLM's
        `chat_template_kwargs`) may override `add_generation_prompt` and
        `continue_final_message`, as in vLLM."""
        kwargs = dict(template_kwargs or {})
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", add_generation_prompt))
        if kwargs.pop("continue_final_message", continue_final_message):
            if add_generation_prompt:
                raise ChatTemplateError("'continue_final_message' needs 'add_generation_prompt': false")
            kwargs["continue_final_message"] = True
        return self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
        """A chat request's prompt ids, as the server builds them (the router repeats this to hash
        them); the template already holds any BOS, so none is added again."""
        text = self.chat_prompt(messages, add_generation_prompt, continue_final_message, template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], /, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for `messages`; raises `ChatTemplateError` (a ValueError) for rejected input."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use the completions API with a plain prompt")
        tools = kwargs.pop("tools", None)
        return render_chat(self.chat_template, messages, add_generation_prompt, tools, self._template_tokens,
                           **kwargs)
