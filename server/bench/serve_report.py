"""Summaries of one load level: throughput, latency percentiles and errors; table, JSON, plot."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .serve_client import RequestResult

PERCENTILES = (50, 90, 99)


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    array = np.asarray(values) * 1000.0
    return {"mean": float(array.mean()), **{f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}}


@dataclass
class LevelReport:
    concurrency: int
    request_rate: float
    completed: int
    errors: int
    duration_s: float
    request_throughput: float        # completed requests / s
    output_throughput: float         # generated tokens / s
    total_throughput: float          # (prompt + generated) tokens / s
    prompt_tokens: int
    output_tokens: int
    ttft_ms: dict[str, float] = field(default_factory=dict)
    tpot_ms: dict[str, float] = field(default_factory=dict)
    itl_ms: dict[str, float] = field(default_factory=dict)
    e2e_ms: dict[str, float] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def summarize(results: list[RequestResult], duration: float, concurrency: int,
              request_rate: float) -> LevelReport:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return LevelReport(
        concurrency=concurrency, request_rate=request_rate, completed=len(done), errors=len(failed),
        duration_s=duration, request_throughput=len(done) / duration,
        output_throughput=output_tokens / duration,
        total_throughput=(prompt_tokens + output_tokens) / duration,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens,
        ttft_ms=_stats_ms([r.ttft for r in done]),
        tpot_ms=_stats_ms([t for r in done if (t := r.tpot) is not None]),
        itl_ms=_stats_ms([gap for r in done for gap in r.itl]),
        e2e_ms=_stats_ms([r.e2e for r in done]),
        error_samples=sorted({r.error for r in failed})[:5])


def format_table(reports: list[LevelReport]) -> str:
    header = ("conc", "rate", "ok", "err", "req/s", "out tok/s", "tot tok/s", "TTFT p50/p90/p99 ms",
              "TPOT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "E2E p50/p90/p99 ms")

    def trio(stats: dict[str, float]) -> str:
        return "/".join(f"{stats[f'p{p}']:.0f}" for p in PERCENTILES)

    rows = [header] + [(
        str(r.concurrency), "inf" if r.request_rate == float("inf") else f"{r.request_rate:g}",
        str(r.completed), str(r.errors), f"{r.request_throughput:.2f}", f"{r.output_throughput:.1f}",
        f"{r.total_throughput:.1f}", trio(r.ttft_ms), trio(r.tpot_ms), trio(r.itl_ms), trio(r.e2e_ms))
        for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    errors = [f"  errors at concurrency {r.concurrency}: {sample}" for r in reports for sample in r.error_samples]
    return "\n".join(lines + errors)


def plot(reports: list[LevelReport], path: str, title: str) -> None:
    """Output throughput and TTFT p99 against concurrency (needs matplotlib)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [r.concurrency for r in reports]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(levels, [r.output_throughput for r in reports], marker="o")
    left.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput", xscale="log", xticks=levels)
    left.set_xticklabels([str(level) for level in levels])
    right.plot(levels, [r.ttft_ms["p99"] / 1000 for r in reports], marker="o", color="tab:red")
    right.set(xlabel="concurrency", ylabel="TTFT p99 (s)", title="time to first token", xscale="log",
              xticks=levels)
    right.set_xticklabels([str(level) for level in levels])
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
