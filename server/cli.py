"""The `kubeinfer` console script.

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; modules are imported only when their subcommand runs, so
`kubeinfer operator` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("kubeinfer.server.generate", "Generate offline from prompts on a model."),
    "serve": ("kubeinfer.server.api.serve", "Run the OpenAI-compatible server."),
    "fetch": ("kubeinfer.server.weights.fetch",
              "Fetch a model (hf://org/name[@revision], s3://bucket/prefix) into the local cache; prints JSON."),
    "bench": ("kubeinfer.server.bench.cli", "Load-test an OpenAI-compatible endpoint."),
    "operator": ("kubeinfer.operator.main", "Run the InferenceService operator (kopf)."),
    "route": ("kubeinfer.server.router.cli",
              "Run the cache-aware router: in front of engines you started (--backend URL ...), or of "
              "an InferenceService's pods, scaling it from zero (--inferenceservice NAME)."),
    "gateway": ("kubeinfer.server.router.cli", "`kubeinfer route`, under the name the operator's "
                "router Deployments run it by."),
    "bench-kernels": ("kubeinfer.kernels.tools.bench", "Time the Triton kernels on a CUDA GPU."),
}


def _build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubeinfer", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # only the chosen subcommand's module is imported
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _build_parser(argv).parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
