"""Tool calling without a model: which format a template speaks, how tools and tool turns reach
templates that know tools and those that do not, the per-family parsers of free text, the
streamed split into content and `delta.tool_calls`, and the grammar that forces a call."""

from __future__ import annotations

import json

import pytest

from kubeinfer.server.api.errors import OpenAIError
from kubeinfer.server.api.protocol import ChatCompletionRequest
from kubeinfer.server.api.tools import (ToolCallStream, parse_auto, plan_tools, template_family,
                                        template_messages)
from kubeinfer.server.model.tokenizer.chat_template import render_chat

pytestmark = pytest.mark.unit

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Small templates in the shape of the two families (written for these tests).
HERMES_STYLE = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
                "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
                "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
                "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}"
                "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
LLAMA_STYLE = ("<|begin_of_text|>{% if tools %}Environment: ipython\n{% for t in tools %}{{ t | tojson }}"
               "{% endfor %}{% endif %}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
               "{% if m.tool_calls %}<|python_tag|>{{ m.tool_calls[0].function | tojson }}{% else %}"
               "{{ m.content }}{% endif %}<|eot_id|>{% endfor %}")


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": [{"role": "user", "content": "Weather in Oslo?"}], **fields})


def _history() -> list[dict]:
    return [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"}]


def test_families_follow_the_template() -> None:
    assert template_family(HERMES_STYLE) == "hermes" and template_family(CHATML) == "hermes"
    assert template_family(LLAMA_STYLE) == "llama3_json"


def test_a_template_without_tools_gets_the_fallback_prompt_and_text_turns() -> None:
    body = _request(messages=_history(), tools=[WEATHER])
    messages, tools = template_messages(body, plan_tools(body, CHATML), CHATML)
    assert tools is None and messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert "<tool_call>" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                           '{"city": "Oslo"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n12 C, rain\n</tool_response>"}
    prompt = render_chat(CHATML, messages, True, None, {})
    assert prompt.count("<|im_start|>") == 5 and prompt.endswith("<|im_start|>assistant\n")


def test_a_template_that_knows_tools_renders_them_itself() -> None:
    body = _request(messages=_history(), tools=[WEATHER])
    messages, tools = template_messages(body, plan_tools(body, HERMES_STYLE), HERMES_STYLE)
    assert tools == [WEATHER] and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    prompt = render_chat(HERMES_STYLE, messages, True, tools, {})
    assert '<tools>{"type": "function"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    llama = render_chat(LLAMA_STYLE, messages, True, tools, {})
    assert '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Oslo"}}' in llama


def test_hermes_calls_are_parsed_out_of_text() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>')
    content, calls = parse_auto(text, "hermes", {"get_weather"})
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}),
                                                                   ("get_weather", {"city": "Rome"})]
    assert len({c.id for c in calls}) == 2
    for not_a_call in ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
                       "<tool_call>{broken json</tool_call>", "no call at all"):
        assert parse_auto(not_a_call, "hermes", {"get_weather"}) == (not_a_call, [])


def test_llama_json_calls_are_parsed_out_of_text() -> None:
    content, calls = parse_auto('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                '{"name": "get_weather", "parameters": {"city": "Rome"}}', "llama3_json",
                                {"get_weather"})
    assert content is None and [json.loads(c.arguments)["city"] for c in calls] == ["Oslo", "Rome"]
    plain = "The weather is {probably} fine."
    assert parse_auto(plain, "llama3_json", {"get_weather"}) == (plain, [])


def _replay(stream: ToolCallStream, pieces: list[str]) -> tuple[str, dict[int, dict]]:
    """Feed deltas, then assemble content and calls as the SDK does."""
    content, calls = "", {}
    outs = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    for text, deltas in outs:
        content += text
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
            call["id"] = delta.get("id", call.get("id"))
            call["name"] += delta["function"].get("name") or ""
            call["arguments"] += delta["function"].get("arguments") or ""
    return content, calls


def test_streamed_auto_text_never_leaks_a_tag_into_content() -> None:
    body = _request(tools=[WEATHER])
    text = 'Checking <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    content, calls = _replay(ToolCallStream(plan_tools(body, CHATML)), pieces)
    assert content == "Checking " and "<" not in content
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
    plain = "No tools <needed> here, 2 < 3."
    content, calls = _replay(ToolCallStream(plan_tools(body, CHATML)), [plain[i:i + 2] for i in range(0, 30, 2)])
    assert content == plain and not calls


def test_streamed_forced_calls() -> None:
    named = plan_tools(_request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                       CHATML)
    content, calls = _replay(ToolCallStream(named), ['{"ci', 'ty": "Oslo"}'])
    assert content == "" and calls[0]["name"] == "get_weather" and calls[0]["arguments"] == '{"city": "Oslo"}'
    required = plan_tools(_request(tools=[WEATHER], tool_choice="required"), CHATML)
    output = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    content, calls = _replay(ToolCallStream(required), [output[:10], output[10:]])
    assert content == "" and json.loads(calls[0]["arguments"]) == {"city": "Oslo"}


def test_forced_grammars() -> None:
    required = plan_tools(_request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False), CHATML)
    schema = required.constraint().json
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    named = plan_tools(_request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                       CHATML)
    assert named.constraint().json == WEATHER["function"]["parameters"]
    assert plan_tools(_request(tools=[WEATHER], tool_choice="auto"), CHATML).constraint() is None
    assert plan_tools(_request(tools=[WEATHER], tool_choice="none"), CHATML) is None


@pytest.mark.parametrize("fields, words", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": [WEATHER, WEATHER]}, "unique"),
])
def test_bad_tool_requests_are_400s(fields, words) -> None:
    with pytest.raises(OpenAIError, match=words) as raised:
        plan_tools(_request(**fields), CHATML)
    assert raised.value.status == 400


TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string"}}}}}


def _replay_deltas(stream: ToolCallStream, text: str, step: int) -> tuple[str, list[tuple[str, list[dict]]], dict]:
    """Feed `text` `step` characters at a time; (content, every (fed so far, deltas), calls as the SDK assembles)."""
    content, history = "", []
    for i in range(0, len(text), step):
        piece, deltas = stream.feed(text[i:i + step])
        content += piece
        history.append((text[:i + step], deltas))
    piece, deltas = stream.finish()
    content += piece
    history.append((text, deltas))
    calls: dict[int, dict] = {}
    for _, deltas in history:
        assert len({d["index"] for d in deltas}) == len(deltas)   # one entry per call in a chunk
        for delta in deltas:
            if delta["index"] not in calls:   # the first delta of a call names it
                assert delta["id"].startswith("call_") and delta["type"] == "function", delta
                assert delta["function"]["name"]
                calls[delta["index"]] = {"name": "", "arguments": ""}
            calls[delta["index"]]["name"] += delta["function"].get("name") or ""
            calls[delta["index"]]["arguments"] += delta["function"].get("arguments") or ""
    return content, history, calls


def _incremental(history: list[tuple[str, list[dict]]], index: int) -> int:
    """How many deltas carried arguments of call `index` before the whole text was in."""
    return sum(1 for _, deltas in history[:-1] for d in deltas
               if d["index"] == index and d["function"].get("arguments"))


def _assert_streams_like_whole(plan, text: str, min_fragments: int = 3, held: tuple[int, ...] = ()) -> dict:
    """Streamed in 1, 4 and 7 character steps, the calls assemble to the non-streamed ones, and
    each call's arguments arrive in pieces (except the `held` calls, whose arguments came first)."""
    whole_content, whole_calls = plan.parse(text)
    for step in (1, 4, 7):
        content, history, calls = _replay_deltas(ToolCallStream(plan), text, step)
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(c.name, c.arguments) for c in whole_calls], (step, calls)
        for index, call in calls.items():  # pieces as generated, not one at the end
            if index in held:
                continue
            wanted = min(min_fragments, max(1, len(call["arguments"]) // step - 1))
            assert _incremental(history, index) >= wanted, (step, index)
    return calls


def test_required_calls_stream_name_first_then_argument_pieces() -> None:
    plan = plan_tools(_request(tools=[WEATHER, TIME], tool_choice="required"), CHATML)
    text = ('[{"name": "get_weather", "parameters": {"city": "Oslo, \\"Norway\\" \\u00e6", "days": [1, 2.50, 1e2]}}, '
            '{"name": "get_time", "parameters": {}}]')
    calls = _assert_streams_like_whole(plan, text)
    assert json.loads(calls[0]["arguments"]) == {"city": 'Oslo, "Norway" æ', "days": [1, 2.5, 100.0]}
    assert calls[1] == {"name": "get_time", "arguments": "{}"}
    # the name goes out before any argument, as soon as it is complete
    _, history, _ = _replay_deltas(ToolCallStream(plan), text, 1)
    first = next(i for i, (_, deltas) in enumerate(history) if deltas)
    assert history[first][0] == '[{"name": "get_weather"' and history[first][1][0]["function"]["arguments"] == ""


def test_named_call_streams_its_arguments_as_the_non_streamed_answer_has_them() -> None:
    named = plan_tools(_request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                       CHATML)
    for text in ('{"city": "Oslo"}', '{ "city" :"Os\\/lo\\ud83d\\ude00",\n "n": 1.0 }', '{"city": "Os', '{"n": 12'):
        _, history, calls = _replay_deltas(ToolCallStream(named), text, 2)
        assert calls[0]["arguments"] == named.parse(text)[1][0].arguments, text
    assert named.parse('{ "city" :"Os\\/lo\\ud83d\\ude00",\n "n": 1.0 }')[1][0].arguments == \
        json.dumps({"city": "Os/lo\U0001F600", "n": 1.0}, ensure_ascii=False)


def test_hermes_auto_calls_stream_incrementally() -> None:
    plan = plan_tools(_request(tools=[WEATHER, TIME]), CHATML)
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "when": "today"}}\n'
            '</tool_call>\n<tool_call>\n{"arguments": {"timezone": "Europe/Oslo"}, "name": "get_time"}\n</tool_call>')
    calls = _assert_streams_like_whole(plan, text, held=(1,))  # its arguments came before its name
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    # string-encoded arguments are whole at the end, still equal to the non-streamed answer
    encoded = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
    _, _, calls = _replay_deltas(ToolCallStream(plan), encoded, 3)
    assert calls[0] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    both = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}, "parameters": {"x": 1}}</tool_call>'
    _, _, calls = _replay_deltas(ToolCallStream(plan), both, 2)
    assert calls[0]["arguments"] == plan.parse(both)[1][0].arguments == '{"city": "Oslo"}'


def test_llama_json_auto_calls_stream_incrementally() -> None:
    plan = plan_tools(_request(tools=[WEATHER, TIME]), LLAMA_STYLE)
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {"timezone": "UTC"}}'
    content, _, calls = _replay_deltas(ToolCallStream(plan), text, 3)
    assert content == "" and [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    _assert_streams_like_whole(plan, text)
