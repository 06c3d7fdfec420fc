"""Run one command in a fresh child process and measure it: wall time, peak RSS, exit status.

Each optimizer and each evaluation runs in its own process, so a crash (onnxoptimizer can abort the
interpreter), a hang or a memory blow-up is a result, never an abort of the benchmark.

Peak RSS is the kernel's high-water mark of the child's own address space (``VmHWM``), which exec resets.
``ru_maxrss`` is no use here: Linux carries the parent's peak into a forked child across exec, so every
child would report at least the harness's own size. The child reports its VmHWM with its result; the
parent also polls it (a crashed child reports nothing) and keeps the larger.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # children import ``bench`` from here


@dataclass
class ProcResult:
    """What one child process did: ``status`` is ok, error (non-zero exit), crash (signal) or timeout."""

    status: str
    returncode: Optional[int]
    wall_s: float
    peak_rss_mb: float
    payload: Optional[dict]
    error: str

    def to_dict(self) -> dict:
        """Plain-dict form for the JSON result file."""
        return asdict(self)


def _tail(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_measured(cmd: Sequence[str], timeout_s: float, max_rss_mb: Optional[float] = None) -> ProcResult:
    """Run ``cmd``; its JSON payload is read from the file named by env ``BENCH_RESULT``.

    The child runs in its own session so a timeout, or an RSS above ``max_rss_mb`` (the machine is
    shared: a peer needing 19 GB must not take everyone down), kills it and anything it spawned.
    Its ``TMPDIR`` is a folder removed when it ends: a killed peer's temporary copies (onnxruntime's
    transformer optimizer writes the whole 3.3 GB model to one) do not pile up in /tmp.
    """
    with tempfile.TemporaryDirectory(prefix="k3bench-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        err_path = os.path.join(tmp, "stderr.txt")
        child_env = dict(os.environ)
        child_env["BENCH_RESULT"] = result_path
        child_env["TMPDIR"] = tmp
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, child_env.get("PYTHONPATH")]))
        child_env.setdefault("OMP_NUM_THREADS", "1")
        with open(err_path, "w") as err:
            t0 = time.perf_counter()
            proc = subprocess.Popen(list(cmd), stdout=subprocess.DEVNULL, stderr=err, env=child_env,
                                    start_new_session=True)
            status, polled_mb, killed = _wait(proc.pid, t0 + timeout_s, max_rss_mb)
            wall = time.perf_counter() - t0
        proc.returncode = 0  # reaped by os.waitpid above; keep Popen from waiting again
        with open(err_path, errors="replace") as f:
            stderr = f.read()
        payload = None
        if os.path.exists(result_path):
            with open(result_path) as f:
                payload = json.load(f)
    peak_mb = max(polled_mb, (payload or {}).pop("vmhwm_mb", 0.0))
    if killed == "timeout":
        return ProcResult("timeout", None, wall, peak_mb, payload, f"killed after {timeout_s:.0f} s")
    if killed:
        return ProcResult(killed, None, wall, peak_mb, payload, f"killed above {max_rss_mb:.0f} MB RSS")
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        return ProcResult("crash", -os.WTERMSIG(status), wall, peak_mb, payload, f"{sig}: {_tail(stderr)}")
    code = os.WEXITSTATUS(status)
    if code != 0 or payload is None:
        return ProcResult("error", code, wall, peak_mb, payload, _tail(stderr) or "no result written")
    return ProcResult("ok", 0, wall, peak_mb, payload, "")


def memory_mb(pid: "int | str" = "self") -> tuple[float, float]:
    """(current RSS, peak RSS) in MB of process ``pid``; zeros when it is gone."""
    found = {"VmRSS:": 0.0, "VmHWM:": 0.0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0] + ":"
                if key in found:
                    found[key] = int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return found["VmRSS:"], found["VmHWM:"]


def _wait(pid: int, deadline: float, max_rss_mb: Optional[float]) -> tuple[int, float, str]:
    """Reap ``pid`` polling its memory; kill its process group at ``deadline`` or above ``max_rss_mb``.

    Between polls (every 0.1 s once the child has run a while) the wait wakes as soon as the child
    exits: through a pidfd where Linux has one, so the wall time is the child's own, not rounded up
    to the next poll (a sleep between polls added 0-100 ms to every sample, 50 ms on average: a
    2.5 % bias on a 2 s run, and wall medians that moved in 0.1 s steps).

    Returns (wait status, peak RSS seen, "" or "timeout" or "memory-limit").
    """
    try:
        exited: Optional[int] = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (not Linux 5.3+): sleep between polls
        exited = None
    delay, peak = 0.005, 0.0
    try:
        while True:
            rss, hwm = memory_mb(pid)
            peak = max(peak, hwm)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status, peak, ""
            killed = "timeout" if time.perf_counter() >= deadline else ""
            killed = "memory-limit" if max_rss_mb and rss > max_rss_mb else killed
            if killed:
                os.killpg(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                return status, peak, killed
            if exited is None:
                time.sleep(delay)
            else:
                select.select([exited], [], [], delay)  # readable once the child has exited
            delay = min(delay * 2, 0.1)
    finally:
        if exited is not None:
            os.close(exited)


def write_result(payload: dict) -> None:
    """Child side: hand ``payload`` back to :func:`run_measured`; run by hand (no ``BENCH_RESULT``), a worker
    prints it instead (a worker is also how to time one optimizer as a whole process with outside tools)."""
    result = {**payload, "vmhwm_mb": memory_mb()[1]}
    if "BENCH_RESULT" not in os.environ:
        print(json.dumps(result))
        return
    with open(os.environ["BENCH_RESULT"], "w") as f:
        json.dump(result, f)


def ram_gib() -> float:
    """Physical memory of this machine in GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def python_module(module: str, *args: str) -> list[str]:
    """Command line running ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]
