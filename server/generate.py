"""`kubeinfer generate "prompt" [...]`: offline generation on a model, streamed to the terminal."""

from __future__ import annotations

import argparse
import logging
import sys

from .flags import ENGINE_FLAGS, add_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="One or more prompts.")
    parser.add_argument("--max-tokens", type=int, default=128, help="Tokens to generate at most.")
    parser.add_argument("--temperature", type=float, default=None,
                        help="0 = greedy (default: the model's generation_config, else 1.0).")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--sampling-seed", type=int, default=None,
                        help="Per-request seed, for reproducible sampling.")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="Wrap each prompt in the model's chat template (--no-chat: raw).")
    add_flags(parser, ENGINE_FLAGS)


def run(args: argparse.Namespace) -> int:
    from .engine.config import EngineConfig
    from .engine.llm_engine import LLMEngine
    from .engine.sampling_params import InvalidRequestError, SamplingParams
    from .weights.fetch import use_local_copy

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if code := use_local_copy(args):   # hf:// and s3:// through the model cache, as `serve` does
        return code
    engine = LLMEngine(EngineConfig.from_args(args))
    given = {name: getattr(args, name) for name in ("temperature", "top_p", "top_k")
             if getattr(args, name) is not None}
    params = SamplingParams(max_tokens=args.max_tokens, seed=args.sampling_seed, **given)
    try:
        for i, prompt in enumerate(args.prompts):
            engine.add_request(str(i), _prompt_ids(engine, prompt, args.chat), params)
    except InvalidRequestError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    stream = len(args.prompts) == 1
    answers: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if stream:
                print(output.outputs[0].delta_text, end="", flush=True)
            if output.finished:
                answers[output.request_id] = output.outputs[0].text
    if stream:
        print()
    else:
        for i, prompt in enumerate(args.prompts):
            print(f"### {prompt}\n{answers[str(i)]}\n")
    return 0


def _prompt_ids(engine: "object", prompt: str, chat: bool) -> list[int]:
    tokenizer = engine.tokenizer  # type: ignore[attr-defined]
    if not chat:
        return tokenizer.encode(prompt)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
