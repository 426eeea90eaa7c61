"""One container of a runner pod as a local process: start, restart per policy, probe, stop.

Why a process group per container: a container's command may fork (uvicorn workers, tensor-
parallel ranks); stopping the group stops them all, as a container runtime would.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .podlogs import ContainerLog
from .probes import Probe
from .processes import record
from kubeinfer.server.exit_codes import TERMINATION_LOG_ENV

INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "KUBEINFER_CACHE")
TERMINATION_MESSAGE_BYTES = 4096   # what the kubelet keeps of a termination message file
BACKOFF_START, BACKOFF_MAX = 2.0, 60.0  # kubelet uses 10 s .. 300 s; shorter keeps tests quick


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class LocalContainer:
    spec: dict
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log_path: Path
    host: str
    restart_policy: str
    grace: float
    pid_file: Path  # lets `cluster down` stop the process even if the runner was killed
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    started_iso: str = ""
    restarts: int = 0
    next_start: float = 0.0
    last_state: dict = field(default_factory=dict)
    terminated: dict | None = None
    killing_until: float = 0.0  # while a probe-failed container has its grace period
    probes: dict[str, Probe] = field(default_factory=dict)
    logs: ContainerLog = field(init=False)

    def __post_init__(self) -> None:
        self.logs = ContainerLog(self.log_path, self.cwd / "cri" / self.spec["name"])
        ports = {p["name"]: p["containerPort"] for p in self.spec.get("ports") or [] if p.get("name")}
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            if kind in self.spec:
                self.probes[kind] = Probe(self.spec[kind], self.host, self.env, ports, ok=kind == "livenessProbe")

    @property
    def termination_file(self) -> Path:
        """The container's terminationMessagePath, a file per container here (no mount namespace):
        kubeinfer's commands find it through exit_codes.TERMINATION_LOG_ENV."""
        return self.cwd / "cri" / f"{self.spec['name']}.termination-log"

    def start(self) -> None:
        base = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
        self.termination_file.parent.mkdir(parents=True, exist_ok=True)
        self.termination_file.write_bytes(b"")
        base[TERMINATION_LOG_ENV] = str(self.termination_file)
        self.logs.begin(self.restarts, f"--- {now_iso()} starting {self.argv}")
        self.proc = subprocess.Popen(self.argv, env={**base, **self.env}, cwd=self.cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
        self.logs.pump(self.proc.stdout, self.proc.stderr)
        record(self.pid_file, self.proc.pid)
        self.started_at, self.started_iso, self.terminated = time.monotonic(), now_iso(), None
        for kind, probe in self.probes.items():
            probe.successes = probe.failures = 0
            probe.ok, probe.last_run = kind == "livenessProbe", float("-inf")

    def _first_exited(self) -> bool:
        """Whether the container's first process exited. It is left unreaped (a zombie) so that
        its pid, which names the process group, cannot go to another process before
        ``_end_group`` has killed what is left of the group."""
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped already
            return True

    def _end_group(self) -> int:
        """SIGKILL every process left in the container's group, as a container runtime does when
        the container's first process exits (its children would otherwise hold the pod IP's
        ports, which the next pod on that IP needs), then reap the first process."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.proc.wait()

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after the pod's grace period, or as soon as
        the first process has exited."""
        if self.proc is not None and self.proc.returncode is None:
            if not self._first_exited():
                try:
                    os.killpg(self.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                deadline = time.monotonic() + self.grace
                while not self._first_exited() and time.monotonic() < deadline:
                    time.sleep(0.1)
            self._end_group()
        self.pid_file.unlink(missing_ok=True)

    def _termination_message(self, code: int) -> str:
        """As the kubelet does it: the termination message file, else with FallbackToLogsOnError the
        failed run's log tail (80 lines, 2 KiB)."""
        try:
            written = self.termination_file.read_bytes()[:TERMINATION_MESSAGE_BYTES]
        except FileNotFoundError:
            written = b""
        if written.strip():
            return written.decode(errors="replace").strip()
        if code == 0 or self.spec.get("terminationMessagePolicy") != "FallbackToLogsOnError":
            return ""
        text = self.log_path.read_bytes()
        run = text[text.rfind(b"\n--- ") + 1:].split(b"\n", 1)[-1]  # after this run's "--- starting" line
        return b"\n".join(run.splitlines()[-80:])[-2048:].decode(errors="replace").strip()

    def _exited(self, code: int, reason: str) -> None:
        self.logs.end()
        self.terminated = {"exitCode": code, "reason": reason, "startedAt": self.started_iso, "finishedAt": now_iso()}
        if message := self._termination_message(code):
            self.terminated["message"] = message
        self.last_state = {"terminated": self.terminated}
        self.proc = None
        self.pid_file.unlink(missing_ok=True)
        if self.restart_policy == "Always" or (self.restart_policy == "OnFailure" and code != 0):
            self.next_start = time.monotonic() + min(BACKOFF_MAX, BACKOFF_START * 2 ** self.restarts)
            self.restarts += 1

    def tick(self) -> None:
        """Notice exits, restart when the backoff has passed, run due probes."""
        now = time.monotonic()
        if self.killing_until:   # a failed liveness or startup probe: SIGTERM sent, grace running
            if self._first_exited() or now >= self.killing_until:
                self._end_group()
                self.killing_until = 0.0
                self._exited(137, "Error")
        elif self.proc is not None and self._first_exited():
            code = self._end_group()
            self._exited(128 - code if code < 0 else code, "Completed" if code == 0 else "Error")
        if self.proc is None:
            if self.next_start and now >= self.next_start:
                self.next_start = 0.0
                self.start()
            return
        startup = self.probes.get("startupProbe")
        for kind, probe in self.probes.items():
            if (kind == "startupProbe" or startup is None or startup.ok) and probe.due(self.started_at, now):
                probe.run(now)
        if self.killing_until:
            return
        liveness = self.probes.get("livenessProbe")
        if (liveness and not liveness.ok) or (startup and startup.failures >= startup.spec.get("failureThreshold", 3)):
            # the grace period runs on later ticks: one pod's shutdown must not hold up every
            # other pod's probes and status, which the same thread runs
            self.killing_until = now + self.grace
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    @property
    def succeeded(self) -> bool:
        """Exited 0 and will not run again (an init container that is done)."""
        return self.proc is None and not self.next_start and (self.terminated or {}).get("exitCode") == 0

    @property
    def ready(self) -> bool:
        readiness = self.probes.get("readinessProbe")
        startup = self.probes.get("startupProbe")
        return (self.proc is not None and not self.killing_until and (startup is None or startup.ok)
                and (readiness is None or readiness.ok))

    def status(self) -> dict:
        if self.proc is not None:
            state = {"running": {"startedAt": self.started_iso}}
        elif self.next_start:
            state = {"waiting": {"reason": "CrashLoopBackOff", "message": f"back-off restarting, see {self.log_path}"}}
        else:
            state = {"terminated": self.terminated or {"exitCode": 0, "reason": "Completed"}}
        startup = self.probes.get("startupProbe")
        return {"name": self.spec["name"], "image": self.spec.get("image", ""), "imageID": "",
                "containerID": f"local://{self.proc.pid}" if self.proc else "", "ready": self.ready,
                "started": self.proc is not None and (startup is None or startup.ok), "restartCount": self.restarts,
                "state": state, "lastState": self.last_state}
