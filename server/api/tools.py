"""Tool calling on /v1/chat/completions: prompts that show the tools, grammars that force a
call, and parsers that find calls in free text.

- The tools reach the model through its chat template when the template knows tools
  (Qwen2.5/Hermes, Llama 3.1 ...); otherwise (e.g. SmolLM2's) a system prompt in the Hermes
  format describes them, and earlier assistant calls and tool results are written out in that
  format too.
- `tool_choice: "required"` and a named function constrain the output with a grammar built
  from the tools' parameter schemas (vLLM's approach), so the arguments always parse: a named
  function generates its arguments object; "required" generates a JSON array of
  `{"name", "parameters"}` objects (one at most when `parallel_tool_calls` is false).
- `tool_choice: "auto"` generates free text and a parser per template family takes the calls
  out of it: Hermes `<tool_call>{...}</tool_call>` blocks, or Llama 3.1's bare JSON object.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from ..engine.sampling_params import StructuredOutputsParams
from .errors import OpenAIError
from .json_stream import JsonPieces, Path, Piece, canonical
from .protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition

Family = Literal["hermes", "llama3_json"]

_TOOLS_VARIABLE = re.compile(r"\btools\b")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
HERMES_OPEN = "<tool_call>"
LLAMA_PYTHON_TAG = "<|python_tag|>"

FALLBACK_SYSTEM_PROMPT = (
    "You are a function calling AI model. You may call one or more functions to assist with the "
    "user query. Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def template_knows_tools(template: str | None) -> bool:
    return bool(template and _TOOLS_VARIABLE.search(template))


def template_family(template: str | None) -> Family:
    """Which call format the model was taught: Llama 3.1's JSON or Hermes tags (also the
    format of our fallback prompt)."""
    if template and (LLAMA_PYTHON_TAG in template or "Environment: ipython" in template):
        return "llama3_json"
    return "hermes"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)


@dataclass
class ToolPlan:
    """How one chat request uses its tools."""

    tools: list[ToolDefinition]
    choice: Literal["auto", "required"] | str  # a function name when one is forced
    parallel: bool
    family: Family

    @property
    def forced_name(self) -> str | None:
        return None if self.choice in ("auto", "required") else self.choice

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that forces a call ("required", named), None for "auto"."""
        if self.forced_name is not None:
            return StructuredOutputsParams(json=self._parameters(self.forced_name))
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                                       "parameters": self._parameters(tool.function.name)},
                      "required": ["name", "parameters"]} for tool in self.tools]
            array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=array)
        return None

    def _parameters(self, name: str) -> dict[str, Any]:
        tool = next(tool for tool in self.tools if tool.function.name == name)
        return tool.function.parameters or {"type": "object", "properties": {}}

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished output."""
        if self.forced_name is not None:
            return None, [ParsedCall(self.forced_name, _compact(text))]
        if self.choice == "required":
            try:
                items = json.loads(text)
            except ValueError:  # cut short by max_tokens: no complete call to report
                return text, []
            return None, [ParsedCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                          for item in items]
        return parse_auto(text, self.family, {tool.function.name for tool in self.tools})


def _compact(text: str) -> str:
    """json.dumps(json.loads(text)) for a whole value, the same form of its start when
    max_tokens cut it short: what the streamed pieces of a named call add up to."""
    return canonical(text)


def parse_auto(text: str, family: Family, names: set[str]) -> tuple[str | None, list[ParsedCall]]:
    """Calls to known tools in free text; text that is not a well-formed call stays content."""
    if family == "llama3_json":
        body = text.strip().removeprefix(LLAMA_PYTHON_TAG).strip()
        if body.startswith("{"):
            calls = [_call(obj, names) for obj in _json_objects(body)]
            if calls and all(calls):
                return None, [call for call in calls if call]
        return text, []
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for match in _HERMES_CALL.finditer(text, start):
        objects = _json_objects(match.group(1))
        call = _call(objects[0], names) if len(objects) == 1 else None
        if call is None:
            return text, []
        calls.append(call)
    content = text[:start].strip()
    return (content or None), calls


def _json_objects(text: str) -> list[Any]:
    """JSON values separated by ';' or whitespace (Llama 3.1 may emit several calls)."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while position < len(text):
        while position < len(text) and text[position] in " \t\r\n;":
            position += 1
        if position == len(text):
            break
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return []
        values.append(value)
    return values


def _call(obj: Any, names: set[str]) -> ParsedCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def plan_tools(body: ChatCompletionRequest, template: str | None) -> ToolPlan | None:
    """The request's tool plan (None: answer in text), or a 400 for a choice that names no tool."""
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if body.tools else "none"
    if choice == "none":
        return None
    if not body.tools:
        raise OpenAIError(400, f"tool_choice {_describe(choice)} needs 'tools'", param="tool_choice")
    names = [tool.function.name for tool in body.tools]
    if len(set(names)) != len(names):
        raise OpenAIError(400, "tools: function names must be unique", param="tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise OpenAIError(400, f"tool_choice names function {choice.function.name!r}, which is not in "
                              f"'tools' ({', '.join(names)})", param="tool_choice")
        choice = choice.function.name
    return ToolPlan(body.tools, choice, body.parallel_tool_calls is not False, template_family(template))


def _describe(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{'function': {choice.function.name!r}}}"


def template_messages(body: ChatCompletionRequest, plan: ToolPlan | None, template: str | None
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template. A template that knows tools gets them as
    they are; for one that does not, the tools become a Hermes-style system prompt and the
    conversation's calls and results are written out in that format."""
    messages = [message.to_template() for message in body.messages]
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if plan and body.tools else None
    if template_knows_tools(template):
        return messages, tools
    has_history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if tools is None and not has_history:
        return messages, None
    rewritten = [_as_text(message) for message in messages]
    if tools is not None:
        prompt = FALLBACK_SYSTEM_PROMPT.format(
            tools="\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools))
        if rewritten and rewritten[0]["role"] in ("system", "developer"):
            rewritten[0] = {**rewritten[0], "content": rewritten[0]["content"] + "\n\n" + prompt}
        else:
            rewritten.insert(0, {"role": "system", "content": prompt})
    return rewritten, None


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    """A tool-aware message for a template that only knows text: calls in <tool_call> tags,
    tool results as a user turn in <tool_response> tags."""
    if message.get("tool_calls"):
        calls = "\n".join(
            HERMES_OPEN + "\n" + json.dumps({"name": call["function"]["name"],
                                             "arguments": call["function"]["arguments"]}, ensure_ascii=False)
            + "\n</tool_call>" for call in message["tool_calls"])
        content = (message["content"] + "\n" if message["content"] else "") + calls
        return {"role": "assistant", "content": content}
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    return message


class ToolCallStream:
    """One streamed choice: splits its text deltas into content and `delta.tool_calls` entries,
    as vLLM streams them: a call's first delta carries its id, type and function name, the
    following ones pieces of `function.arguments` as the model writes them.

    The arguments are re-serialized piece by piece (`json_stream.JsonPieces`) into the form the
    non-streamed answer holds, so what a client assembles equals it. A named function's output
    is its arguments; "required" output is a JSON array of `{"name", "parameters"}`; "auto" text
    streams as content until a call may begin (a `<tool_call>` tag, or Llama's leading `{`), and
    each `{"name", "arguments"}` object after it is a call once its name is a known tool.
    `finish` reconciles with the parse of the whole text: whatever the pieces did not deliver
    (a call the scanner could not follow, string-encoded arguments) is sent then.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.content_sent = 0  # characters of `text` already sent as content
        self.num_calls = 0
        self._names = {tool.function.name for tool in plan.tools}
        self._calls: list[_StreamedCall] = []
        self._by_object: dict[tuple[int, Path], _StreamedCall] = {}  # (block, object path) -> call
        self._blocks: list[tuple[JsonPieces, int]] = []  # Hermes: one reader per <tool_call>, chars fed
        if plan.forced_name is not None:
            self._open_call(plan.forced_name)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) to send now."""
        self.text += delta
        out: list[dict[str, Any]] = []
        content = ""
        if self.plan.forced_name is not None:
            self._read_forced(0, out)
        elif self.plan.choice == "required":
            self._read_object_stream(0, self.text, out, key="parameters", depth=3)
        else:
            safe = self._content_end()
            content = self.text[self.content_sent:safe]
            self.content_sent = max(self.content_sent, safe)
            self._read_auto(out)
        return content, _one_entry_per_call(out)

    # -- reading -------------------------------------------------------------------------------

    def _reader(self, block: int) -> tuple[JsonPieces, int]:
        while len(self._blocks) <= block:
            self._blocks.append((JsonPieces(), 0))
        return self._blocks[block]

    def _read(self, block: int, text: str) -> list[Piece]:
        """The pieces of block `block` whose text is now `text` (it only grows)."""
        reader, fed = self._reader(block)
        self._blocks[block] = (reader, max(fed, len(text)))
        return reader.feed(text[fed:])

    def _read_forced(self, block: int, out: list[dict[str, Any]]) -> None:
        call = self._calls[0]
        if not call.announced:
            out.append(call.header())
        for piece in self._read(block, self.text):
            self._arguments(call, piece.text, out)

    def _read_object_stream(self, block: int, text: str, out: list[dict[str, Any]], key: str,
                            depth: int, keys: tuple[str, ...] = ()) -> None:
        """Calls are the objects whose fields sit `depth` levels in (the array items of
        "required", the values of a Llama sequence or of a Hermes block): their "name", then
        their arguments."""
        arg_keys = (key, *keys)
        for piece in self._read(block, text):
            if len(piece.path) < depth:
                continue
            where, field_name = piece.path[:depth - 1], piece.path[depth - 1]
            # arguments that come before the name are held in a call without an index yet
            call = self._by_object.setdefault((block, where), _StreamedCall(-1, ""))
            if field_name == "name" and piece.complete_scalar and call.index < 0 \
                    and isinstance(piece.value, str) and piece.value in self._names:
                call.index, call.name = len(self._calls), piece.value
                self._calls.append(call)
                out.append(call.header())
                pending, call.pending = call.pending, ""
                self._arguments(call, pending, out)
            elif field_name in arg_keys and call.arguments_key in (None, field_name):
                if call.arguments_key is None:  # the first of "arguments"/"parameters" is streamed
                    call.arguments_key = field_name
                    call.streamable = piece.text.startswith("{")  # string-encoded arguments wait for finish
                if not call.streamable:
                    continue
                if call.index < 0:
                    call.pending += piece.text
                else:
                    self._arguments(call, piece.text, out)

    def _read_auto(self, out: list[dict[str, Any]]) -> None:
        if self.plan.family == "llama3_json":
            stripped = self.text.lstrip()
            if not stripped.startswith(("{", LLAMA_PYTHON_TAG)):
                return
            body = stripped.removeprefix(LLAMA_PYTHON_TAG)
            self._read_object_stream(0, body, out, key="arguments", keys=("parameters",), depth=2)
            return
        position, block = self.text.find(HERMES_OPEN), 0
        while position >= 0:
            begin = position + len(HERMES_OPEN)
            end = self.text.find("</tool_call>", begin)
            self._read_object_stream(block, self.text[begin:len(self.text) if end < 0 else end], out,
                                     key="arguments", keys=("parameters",), depth=2)
            if end < 0:
                break
            position, block = self.text.find(HERMES_OPEN, end), block + 1

    def _open_call(self, name: str) -> _StreamedCall:
        call = _StreamedCall(len(self._calls), name)
        self._calls.append(call)
        return call

    @staticmethod
    def _arguments(call: _StreamedCall, text: str, out: list[dict[str, Any]]) -> None:
        if text:
            call.sent += text
            out.append({"index": call.index, "function": {"arguments": text}})

    def _content_end(self) -> int:
        """How much of the auto text is surely content (not the start of a call)."""
        if self.plan.family == "llama3_json":
            stripped = self.text.lstrip()
            if (not stripped or stripped.startswith(("{", LLAMA_PYTHON_TAG))
                    or LLAMA_PYTHON_TAG.startswith(stripped)):
                return self.content_sent
            return len(self.text)
        start = self.text.find(HERMES_OPEN)
        if start >= 0:
            return start
        for keep in range(min(len(HERMES_OPEN) - 1, len(self.text)), 0, -1):  # a tag may be arriving
            if HERMES_OPEN.startswith(self.text[-keep:]):
                return len(self.text) - keep
        return len(self.text)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The rest once the choice is done: (content delta, tool-call deltas). What was streamed
        is checked against the parse of the whole text, and what it lacks is sent now."""
        out: list[dict[str, Any]] = []
        if self.plan.forced_name is not None:  # a number still open at the end is complete now
            for piece in self._reader(0)[0].flush():
                self._arguments(self._calls[0], piece.text, out)
        _, calls = self.plan.parse(self.text)
        # Without calls all the text is content; with them, the text before the first call.
        end = len(self.text) if not calls else max(self.text.find(HERMES_OPEN), self.content_sent)
        rest = "" if self.plan.forced_name is not None else self.text[self.content_sent:end]
        self.content_sent = len(self.text)
        for i, call in enumerate(calls):
            streamed = self._calls[i] if i < len(self._calls) else self._open_call(call.name)
            if not streamed.announced:
                out.append(streamed.header())
            if streamed.name == call.name and call.arguments.startswith(streamed.sent):
                self._arguments(streamed, call.arguments[len(streamed.sent):], out)
        self.num_calls = len(calls)
        return rest, _one_entry_per_call(out)


@dataclass
class _StreamedCall:
    index: int  # -1: its arguments began before its name (held in `pending`)
    name: str
    id: str = field(default_factory=new_call_id)
    sent: str = ""  # arguments text sent so far
    pending: str = ""
    arguments_key: str | None = None  # which field holds the arguments, once seen
    streamable: bool = True

    announced: bool = False  # its header (id, type, name) went out

    def header(self) -> dict[str, Any]:
        self.announced = True
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": ""}}


def _one_entry_per_call(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per index in a delta (the SDK keeps only one of two): header and argument
    pieces of one call merged, in order."""
    merged: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        entry = merged.get(delta["index"])
        if entry is None:
            merged[delta["index"]] = {**delta, "function": dict(delta["function"])}
        else:
            entry["function"]["arguments"] = entry["function"].get("arguments", "") + \
                delta["function"].get("arguments", "")
    return list(merged.values())
