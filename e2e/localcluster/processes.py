"""Start and stop the cluster's plain processes by pid, with one log file each.

Why pid files carry the process start time: after a reboot a stale pid may belong to someone
else; we only ever signal a pid whose /proc start time still matches what we recorded.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path


class PortInUse(RuntimeError):
    pass


def check_ports_free(ports: dict[str, int], host: str = "127.0.0.1") -> None:
    """Fail before starting anything if a port we need is taken, naming the port and its user."""
    for name, port in ports.items():
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as err:
                raise PortInUse(f"port {host}:{port} (for {name}) is already in use ({err.strerror}); stop whatever "
                                f"listens there or set KUBEINFER_CLUSTER_PORT_BASE to another range") from None


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: starttime in clock ticks since boot


def spawn(name: str, argv: list[str], state: Path, env: dict[str, str] | None = None) -> int:
    """Start ``argv`` in its own session (so a Ctrl-C in the caller does not kill it)."""
    (state / "logs").mkdir(parents=True, exist_ok=True)
    (state / "pids").mkdir(parents=True, exist_ok=True)
    with open(state / "logs" / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True)
    record(state / "pids" / f"{name}.pid", proc.pid)
    return proc.pid


def record(pid_file: Path, pid: int) -> None:
    """Remember a process so `stop` can find it, even one started by another process (the runner)."""
    pid_file.write_text(f"{pid} {_start_time(pid)}\n")


def running(state: Path) -> dict[str, int]:
    """name -> pid for every recorded process that is still the one we started."""
    alive = {}
    for pidfile in sorted((state / "pids").glob("*.pid")):
        try:
            pid, started = pidfile.read_text().split()
        except (OSError, ValueError):  # removed or being written by the runner right now
            continue
        if _start_time(int(pid)) == started and not _is_zombie(int(pid)):
            alive[pidfile.stem] = int(pid)
    return alive


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def stop(state: Path, order: list[str], grace: float = 10.0) -> list[int]:
    """SIGTERM each recorded process in ``order`` ("*": all unlisted ones), SIGKILL what outlives ``grace``."""
    alive = running(state)
    rest = [n for n in alive if n not in order]
    names = [m for n in order for m in (rest if n == "*" else [n]) if m in alive]
    for name in names:
        _signal_group(alive[name], signal.SIGTERM)
        deadline = time.monotonic() + grace
        while alive[name] in running(state).values() and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive[name] in running(state).values():
            _signal_group(alive[name], signal.SIGKILL)
    for pidfile in (state / "pids").glob("*.pid"):
        pidfile.unlink()
    return [alive[n] for n in names]


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Our processes lead their own session: signal the group so their children go too."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def pid_alive(pid: int) -> bool:
    return not _is_zombie(pid)
