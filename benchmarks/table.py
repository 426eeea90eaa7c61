"""Markdown table of a peers.sh run: one row per engine, the issue's headline figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ENGINES = ("kubeinfer", "vllm", "llamacpp", "transformers")


def _levels(path: Path) -> dict[int, dict]:
    if not path.exists():
        return {}
    return {level["concurrency"]: level for level in json.loads(path.read_text())["levels"]}


def main(results: Path) -> None:
    print("| engine | out tok/s c=1 | c=4 | c=16 | c=32 | TTFT p99 c=16 (s) | TTFT p99 c=32 (s) "
          "| shared-prefix out tok/s c=16 | shared-prefix TTFT p99 (s) | ready after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for engine in ENGINES:
        random, shared = _levels(results / f"{engine}-random.json"), _levels(results / f"{engine}-shared-prefix.json")
        if not random:
            continue

        def tput(level: dict | None) -> str:
            return f"{level['output_throughput']:.0f}" if level else "-"

        def ttft(level: dict | None) -> str:
            return f"{level['ttft_ms']['p99'] / 1000:.2f}" if level and "ttft_ms" in level else "-"

        load = results / f"{engine}-load.txt"
        ready = load.read_text().split("after")[-1].strip() if load.exists() else "-"
        cells = [tput(random.get(c)) for c in (1, 4, 16, 32)] + [ttft(random.get(16)), ttft(random.get(32)),
                                                                 tput(shared.get(16)), ttft(shared.get(16)), ready]
        print(f"| {engine} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
