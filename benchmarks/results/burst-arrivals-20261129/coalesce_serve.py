"""kubeinfer serve where an idle engine's first step waits until the inbox has been quiet for
COALESCE_QUIET_MS (capped at COALESCE_CAP_MS); 0 = today's behaviour. A probe, not the product."""
import os, sys, time
from kubeinfer.server.engine import async_engine
QUIET = float(os.environ.get("COALESCE_QUIET_MS", "0")) / 1e3
CAP = float(os.environ.get("COALESCE_CAP_MS", "20")) / 1e3
orig = async_engine.AsyncEngine._drain_inbox
def drain(self):
    idle = not self.engine.has_unfinished_requests()
    orig(self)
    if not (QUIET and idle and self.engine.has_unfinished_requests()):
        return
    start = last_change = time.monotonic()
    count = len(self.engine.scheduler.waiting)
    while time.monotonic() - start < CAP and time.monotonic() - last_change < QUIET:
        time.sleep(0.0005)
        orig(self)
        if len(self.engine.scheduler.waiting) != count:
            count, last_change = len(self.engine.scheduler.waiting), time.monotonic()
async_engine.AsyncEngine._drain_inbox = drain
from kubeinfer.server.cli import main
sys.exit(main(sys.argv[1:]))
