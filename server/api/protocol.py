"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), validated by pydantic.

Unknown fields are ignored, as OpenAI and vLLM do, so newer clients keep working; fields
that would silently change the meaning of a request (suffix) are refused.
Numbers must be finite (JSON's `NaN`/`Infinity` extensions are refused) and text must be valid
Unicode: a lone surrogate (`"\ud800"`) cannot be tokenized or sent back, so it is a 400 that
names the field. The engine (`SamplingParams.validate`) owns the finer domains of the values.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..engine.sampling_params import MAX_LOGPROBS, SEED_RANGE

MAX_PROMPTS = 2048  # prompts in one /v1/completions request, OpenAI's documented limit
_SURROGATE = re.compile("[\ud800-\udfff]")


def _find_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (key or value) holding a lone surrogate, if any."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _SURROGATE.search(key):
                return path or "body"
            found = _find_surrogate(item, here)
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, (str, dict, list)):
                found = _find_surrogate(item, f"{path}.{index}")
                if found:
                    return found
    return None


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class InvalidText(ValueError):
    """Text that is not valid Unicode; `param` is the path of the field that holds it."""

    def __init__(self, param: str) -> None:
        super().__init__(f"{param}: contains a lone UTF-16 surrogate, which is not valid Unicode text")
        self.param = param


class InvalidField(ValueError):
    """A field whose value the request's other fields rule out; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class RequestBody(OpenAIModel):
    """A whole request body: refused before field validation if any text is invalid Unicode
    (the 400 names the field: `errors._validation_message` reads `InvalidText.param`)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        path = _find_surrogate(data, "")
        if path:
            raise InvalidText(path)
        return data


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: str
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling parameters (the openai client sends them via `extra_body`).
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs (server/api/structured.py): OpenAI's, vLLM's and vLLM's older names.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    # vLLM's: the top-k per prompt position (with the prompt token); 0 = the prompt token alone
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> SamplingRequest:
        if self.stream and self.prompt_logprobs:  # vLLM's rule: no stream chunk carries them
            raise InvalidField("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`.")
        return self


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: with `echo`, the prompt alone (its logprobs scored)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt in front of the completion, text and logprobs
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @property
    def echo_only(self) -> bool:
        """OpenAI's `echo` with `max_tokens: 0`: the prompt and its logprobs, nothing generated."""
        return self.echo and self.max_tokens == 0

    @model_validator(mode="after")
    def _check_supported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("'suffix' is not supported")
        if self.max_tokens == 0 and not self.echo:   # vLLM's SamplingParams refuses it so
            raise InvalidField("max_tokens", "max_tokens must be at least 1, got 0 (0 is accepted only with "
                               "'echo': true, for the prompt's logprobs).")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("'best_of' must equal 'n' (beam/best-of search is not supported)")
        if self.prompt == "" or self.prompt == []:
            raise ValueError("'prompt' must not be empty")
        return self

    @field_validator("prompt")
    @classmethod
    def _at_most_max_prompts(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        return prompt


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call

    def to_template(self) -> dict[str, Any]:
        """The dict chat templates expect: text parts joined into one string; tool calls with
        their arguments parsed (HF templates render `arguments` as an object)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: the template shows it as given


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_supported(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("'top_logprobs' requires 'logprobs': true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("'continue_final_message' needs 'add_generation_prompt': false")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize: either a prompt (its TokenizeCompletionRequest) or chat messages
    rendered with the chat template (its TokenizeChatRequest)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)   # as /v1/chat/completions
    # vLLM's defaults: true for a prompt; false for messages (the template writes any BOS)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False  # also the token strings (the tokenizer's own pieces)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidField("continue_final_message",
                               "'continue_final_message' needs 'add_generation_prompt': false")
        return self

    @property
    def special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]
