"""Per level, kubeinfer/vLLM TTFT p50 and p99 ratios in each round of an alternate.sh TTFT_LEVELS console."""
import re, sys
rounds, cur = {}, None
for line in open(sys.argv[1]):
    m = re.match(r"round (\d+) (\S+) ", line)
    if m:
        cur = rounds.setdefault(int(m[1]), {}).setdefault(m[2], {}); continue
    m = re.match(r"\s+(random|shared) c=(\d+) (burst|loop):\s+(.*)", line)
    if m and cur is not None:
        p50, _, p99 = (float(x) for x in m[4].split()[7].split("/"))
        cur[f"{m[1]} c={m[2]} {m[3]}"] = (p50, p99)
levels = list(next(iter(next(iter(rounds.values())).values())))
print("level | " + " | ".join(f"round {r}: p50, p99 (ms, kubeinfer/vLLM)" for r in sorted(rounds)))
for level in levels:
    cells = []
    for r in sorted(rounds):
        k, v = rounds[r]["w8a8"][level], rounds[r]["vllm"][level]
        cells.append(f"{k[0] / v[0]:.2f}, {k[1] / v[1]:.2f} ({k[1]:.0f}/{v[1]:.0f})")
    print(f"{level} | " + " | ".join(cells))
