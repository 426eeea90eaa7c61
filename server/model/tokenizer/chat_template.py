"""Render chat templates the way transformers' `apply_chat_template` does.

Templates come from model files (untrusted), so they run in jinja2's immutable sandbox, with
the same environment HF builds: `trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` that
keeps non-ASCII text, `raise_exception`, `strftime_now`, and `{% generation %}` blocks.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template rejected the conversation (e.g. its `raise_exception`), or failed to render."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for training masks; render it as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from exc


def render_chat(source: str, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
                special_tokens: dict[str, str | None], /, **kwargs: Any) -> str:
    """`kwargs` are template variables: any name, none of them can clash with a parameter."""
    try:
        variables = {**special_tokens, **kwargs, "messages": messages, "tools": tools,
                     "add_generation_prompt": add_generation_prompt}
        return compile_template(source).render(variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from exc
