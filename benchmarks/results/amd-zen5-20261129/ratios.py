"""Per-round kubeinfer/vLLM ratios from an alternate.sh console: c=32 tok/s, TTFT p99 c=16, c=32, shared tok/s."""
import re, sys
for path in sys.argv[1:]:
    rounds = {}
    cur = None
    for line in open(path):
        m = re.match(r"round (\d+) (\S+) ", line)
        if m:
            cur = rounds.setdefault(int(m[1]), {}).setdefault(m[2], {}); continue
        m = re.match(r"\s+(random|shared) c=(\d+):\s+(.*)", line)
        if m and cur is not None:
            f = m[3].split()
            cur[f"{m[1]}{m[2]}"] = (float(f[5]), float(f[7].split("/")[2]), f[7])
    print(path)
    for r, arms in sorted(rounds.items()):
        names = list(arms)
        peer = "vllm" if "vllm" in arms else "baseline"
        for a in names:
            if a == peer: continue
            k, v = arms[a], arms[peer]
            out = [f"round {r} {a}/{peer}:"]
            for key in ("random32", "shared16", "random16", "random1"):
                if key in k and key in v:
                    out.append(f"{key} tok/s {k[key][0]/v[key][0]:.2f} ttft99 {k[key][1]/v[key][1]:.2f} ({k[key][1]:.0f}/{v[key][1]:.0f})")
            print("  " + "  ".join(out))
