import sys, time
from kubeinfer.server.engine import llm_engine
log = open("/tmp/s23/steps.log", "w")
real_step = llm_engine.LLMEngine.step
def step(self):
    s = time.time()
    waiting = len(self.scheduler.waiting); running = len(self.scheduler.running)
    out = real_step(self)
    e = time.time()
    log.write(f"{s:.3f} {e:.3f} {(e-s)*1e3:.0f}ms waiting_before={waiting} running_before={running} outputs={len(out)}\n"); log.flush()
    return out
llm_engine.LLMEngine.step = step
from kubeinfer.server.engine import async_engine
real_gen = async_engine.AsyncEngine.generate
def generate(self, request_id, prompt, params=None):
    log.write(f"{time.time():.3f} add {request_id}\n"); log.flush()
    return real_gen(self, request_id, prompt, params)
async_engine.AsyncEngine.generate = generate
import uvicorn.protocols.http.h11_impl as h11
for mod in (h11,):
    cls = getattr(mod, "HttpToolsProtocol", None) or getattr(mod, "H11Protocol", None)
    if cls is None: continue
    real_dr = cls.data_received
    def data_received(self, data, _real=real_dr):
        if data.startswith(b"POST"):
            log.write(f"{time.time():.3f} http POST\n"); log.flush()
        return _real(self, data)
    cls.data_received = data_received
from kubeinfer.server.cli import main
sys.argv = ["kubeinfer"] + sys.argv[1:]
sys.exit(main())
