import sys, time, random, torch
from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams
llm = LLM(model=sys.argv[1], kv_cache_memory=1<<30, max_num_seqs=64)
eng = llm.engine
rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
def burst(n, L, out):
    p = SamplingParams(max_tokens=out, temperature=0, ignore_eos=True)
    ids = []
    for i in range(n):
        rid = f"r{rng.random()}"
        eng.add_request(rid, [rng.randrange(1000, 20000) for _ in range(L)], p)
        ids.append(rid)
    return ids
# warm: a burst, recording sizes
burst(32, 128, 16)
while eng.has_unfinished_requests(): eng.step()
for rnd in range(3):
    t0 = time.perf_counter(); burst(32, 128, 128); first = {}; steps = []
    while eng.has_unfinished_requests():
        s = time.perf_counter(); outs = eng.step(); e = time.perf_counter()
        steps.append((e - s) * 1e3)
        for o in outs:
            if o.request_id not in first and o.outputs and o.outputs[0].token_ids:
                first[o.request_id] = (e - t0) * 1e3
    ttft = sorted(first.values())
    print(f"round {rnd}: TTFT p50 {ttft[len(ttft)//2]:.0f} max {ttft[-1]:.0f} ms; first 5 steps {[round(x) for x in steps[:5]]}; decode step median {sorted(steps[5:])[len(steps[5:])//2]:.1f} ms; total {(time.perf_counter()-t0)*1e3:.0f} ms, {len(steps)} steps")
t0 = time.perf_counter(); burst(32, 128, 8); seen = set()
while eng.has_unfinished_requests():
    s = time.perf_counter(); outs = eng.step(); e = time.perf_counter()
    new = [o.request_id for o in outs if o.request_id not in seen and o.outputs and o.outputs[0].token_ids]
    seen.update(new)
    print(f"step {(e-s)*1e3:.0f} ms at {(e-t0)*1e3:.0f}: outputs {len(outs)}, first tokens {len(new)}")
