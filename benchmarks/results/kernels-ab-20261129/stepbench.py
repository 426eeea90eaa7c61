import sys, time, torch, gc, statistics
from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams
P="/root/.cache/kubeinfer/peers/smollm2-w8a8" if sys.argv[1]=="w8a8" else "/root/.cache/kubeinfer/peers/smollm2-hf"
llm=LLM(model=P, kv_cache_memory=1<<30, enable_prefix_caching=False)
g=torch.Generator().manual_seed(0)
def prompts(n): return [torch.randint(100,40000,(128,),generator=g).tolist() for _ in range(n)]
eng=llm.engine if hasattr(llm,'engine') else llm.llm_engine
times=[]
orig=type(eng).step
def step(self):
    t=time.perf_counter(); o=orig(self); times.append((self.counters.last_step_tokens, time.perf_counter()-t)); return o
type(eng).step=step
llm.generate(prompts(32), SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)); gc.freeze()
times.clear()
for i in range(4): llm.generate(prompts(32), SamplingParams(max_tokens=64, ignore_eos=True, temperature=0))
pre=[t for n,t in times if n>=1024]; dec=[t for n,t in times if n==32]
print(f"prefill2048 median {statistics.median(pre)*1e3:.1f} ms (n={len(pre)})  decode32 median {statistics.median(dec)*1e3:.2f} ms (n={len(dec)})")
