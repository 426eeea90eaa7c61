"""kubeinfer serve with every engine step logged: (wall time, step ms, prefill tokens, #prefill seqs, #decodes, #waiting)."""
import sys, time, json, threading
from kubeinfer.server.engine import llm_engine
from kubeinfer.server.engine import async_engine
LOG = open(sys.argv.pop(1), "w", buffering=1)
orig_step = llm_engine.LLMEngine.step
orig_add = llm_engine.LLMEngine.add_request if hasattr(llm_engine.LLMEngine, "add_request") else None
def step(self):
    t0 = time.monotonic()
    waiting = len(self.scheduler.waiting)
    running = len(self.scheduler.running)
    outs = orig_step(self)
    t1 = time.monotonic()
    c = self.counters
    firsts = sum(1 for o in outs if o is not None and getattr(o, "outputs", None) and len(o.outputs[0].token_ids) == 1)
    LOG.write(json.dumps({"t0": t0, "ms": round((t1 - t0) * 1e3, 1), "tokens": c.last_step_tokens if c.last_step_time >= t0 else 0,
                          "seqs": c.last_step_seqs if c.last_step_time >= t0 else 0, "waiting_before": waiting,
                          "running_before": running, "firsts": firsts}) + "\n")
    return outs
llm_engine.LLMEngine.step = step
if orig_add is not None:
    def add(self, *a, **k):
        LOG.write(json.dumps({"add": time.monotonic()}) + "\n")
        return orig_add(self, *a, **k)
    llm_engine.LLMEngine.add_request = add
orig_gen = async_engine.AsyncEngine.generate
async def gen(self, *a, **k):
    LOG.write(json.dumps({"arrive": time.monotonic()}) + "\n")
    async for item in orig_gen(self, *a, **k):
        yield item
async_engine.AsyncEngine.generate = gen
import fastapi
orig_call = fastapi.FastAPI.__call__
async def call(self, scope, receive, send):
    if scope["type"] == "http" and scope.get("path","").startswith("/v1/c"):
        LOG.write(json.dumps({"asgi": time.monotonic()}) + "\n")
    await orig_call(self, scope, receive, send)
fastapi.FastAPI.__call__ = call
from kubeinfer.server.cli import main
sys.exit(main(sys.argv[1:]))
