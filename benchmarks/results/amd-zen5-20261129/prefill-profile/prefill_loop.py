import sys, time, torch
from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams
P="/root/.cache/kubeinfer/peers/smollm2-w8a8" if sys.argv[1]=="w8a8" else "/root/.cache/kubeinfer/peers/smollm2-hf"
llm=LLM(model=P, kv_cache_memory=1<<30, enable_prefix_caching=False)
g=torch.Generator().manual_seed(0)
def prompts(n): return [torch.randint(100,40000,(128,),generator=g).tolist() for _ in range(n)]
sp=SamplingParams(max_tokens=int(sys.argv[2]), ignore_eos=True, temperature=0)
llm.generate(prompts(32), sp)
for i in range(int(sys.argv[3])):
    t=time.perf_counter(); llm.generate(prompts(32), sp); print("wall", round(time.perf_counter()-t,3), flush=True)
