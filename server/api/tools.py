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
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text  # cut short by max_tokens: returned as generated


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
    """One streamed choice: splits its text deltas into content and `delta.tool_calls` entries.

    A named function streams its arguments as they are generated; "required" output is a JSON
    array, sent as whole calls once complete; "auto" text streams as content until a call may
    begin (a `<tool_call>` tag, or Llama's leading `{`), and the calls are sent at the end.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.content_sent = 0  # characters of `text` already sent as content
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) to send now."""
        first = not self.text
        self.text += delta
        name = self.plan.forced_name
        if name is not None:
            if first:  # one entry per index in a delta: the SDK keeps only one of two
                self.num_calls = 1
                return "", [{"index": 0, "id": new_call_id(), "type": "function",
                             "function": {"name": name, "arguments": delta}}]
            return "", [{"index": 0, "function": {"arguments": delta}}] if delta else []
        if self.plan.choice == "required":
            return "", []
        safe = self._content_end()
        content = self.text[self.content_sent:safe]
        self.content_sent = max(self.content_sent, safe)
        return content, []

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
        """The rest once the choice is done: (content delta, tool-call deltas)."""
        if self.plan.forced_name is not None:
            return "", []
        _, calls = self.plan.parse(self.text)
        # Without calls all the text is content; with them, the text before the first call.
        end = len(self.text) if not calls else max(self.text.find(HERMES_OPEN), self.content_sent)
        rest = self.text[self.content_sent:end]
        self.content_sent = len(self.text)
        self.num_calls = len(calls)
        return rest, [{"index": i, "id": call.id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}}
                      for i, call in enumerate(calls)]
