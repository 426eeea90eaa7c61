"""`kubeinfer bench serve|throughput`, named after vLLM's `vllm bench serve|throughput`."""

from __future__ import annotations

import argparse
import importlib

MODES: dict[str, tuple[str, str]] = {
    "serve": ("kubeinfer.server.bench.serve", "Load-test a running OpenAI-compatible endpoint."),
    "throughput": ("kubeinfer.server.bench.throughput", "Offline engine throughput, no HTTP."),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    for name, (module_name, help_text) in MODES.items():
        sub = modes.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)


def run(args: argparse.Namespace) -> int:
    return int(args.run(args) or 0)
