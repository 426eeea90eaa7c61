import sys, time, torch, gc, statistics, collections
from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams
from kubeinfer.server.engine import cpu_graphs, model_runner, scheduler as sch, sampler as smp, llm_engine
P="/root/.cache/kubeinfer/peers/smollm2-w8a8"
llm=LLM(model=P, kv_cache_memory=1<<30, enable_prefix_caching=False)
g=torch.Generator().manual_seed(0)
def prompts(n): return [torch.randint(100,40000,(128,),generator=g).tolist() for _ in range(n)]
T=collections.defaultdict(list)
def wrap(cls, name, key):
    orig=getattr(cls,name)
    def f(*a, **k):
        t=time.perf_counter(); r=orig(*a, **k); T[key].append(time.perf_counter()-t); return r
    setattr(cls,name,f)
wrap(llm_engine.LLMEngine,'step','step')
wrap(sch.Scheduler,'schedule','schedule')
wrap(sch.Scheduler,'update','update')
wrap(model_runner.ModelRunner,'_host_step','host_step')
wrap(model_runner.ModelRunner,'run','run')
wrap(cpu_graphs.CpuDecodeGraphs,'_replay','layers')
wrap(cpu_graphs.CpuDecodeGraphs,'fill','fill')
import kubeinfer.server.model.families.llama as L
wrap(L.LlamaForCausalLM,'logits','lm_head')
wrap(L.LlamaForCausalLM,'final_norm','final_norm')
eng=llm.llm_engine if hasattr(llm,'llm_engine') else llm.engine
wrap(type(eng.sampler),'__call__','sampler')
sp=SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
llm.generate(prompts(32), sp); gc.freeze()
for k in T: T[k].clear()
for i in range(3): llm.generate(prompts(32), sp)
# decode steps only: use the steps whose time < 100ms
n=len(T['step'])
for k,v in T.items():
    vv=sorted(v)[:int(len(v)*0.9)]
    print(f"{k:12s} n={len(v):4d} median {statistics.median(v)*1e3:7.3f} ms")
