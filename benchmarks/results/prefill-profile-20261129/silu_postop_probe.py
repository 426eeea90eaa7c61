import time, torch
from kubeinfer.kernels import ops as ops_cpu
from kubeinfer.server.model.layers.linear import pack_weight
torch.manual_seed(0)
H, I = 576, 1536
w = (torch.randn(2*I, H)*0.05).to(torch.bfloat16)
pw = pack_weight(w)
pg, pu = pack_weight(w[:I].contiguous()), pack_weight(w[I:].contiguous())
lp = torch.ops.mkldnn._linear_pointwise
def cur(x): return ops_cpu.silu_and_mul(lp(x, pw, None, "none", [], ""))
def fused(x):
    g = lp(x, pg, None, "swish", [], "")
    return lp.binary(x, g, pu, None, "mul")
def best(f, x, n=30):
    f(x); ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(x); ts.append(time.perf_counter()-t)
    return min(ts)*1e6
for M in (2, 8, 32, 64, 256, 2048):
    x = torch.randn(M, H).to(torch.bfloat16)
    a, b = cur(x).float(), fused(x).float()
    err = ((a-b).abs().max() / a.abs().max()).item()
    r = [(best(cur, x), best(fused, x)) for _ in range(3)]
    print(M, "cur us", [round(p[0]) for p in r], "fused us", [round(p[1]) for p in r], "rel maxdiff", round(err, 4), flush=True)
