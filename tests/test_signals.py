"""Signals through a real process (issue #26, item 3): SIGINT, SIGTERM and SIGHUP end a run with one
line and exit 2 and leave nothing behind, wherever they arrive; a SIGKILLed save's folder is removed
by the next save of the same output, a live writer's never.

The child is ``k3opt.entry.main`` with one function made to announce "READY" on stdout and wait, so
each signal lands at a known step (no timing).
"""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from k3opt.modelio.temp_folders import remove_dead, temp_folders
from tests.helpers import make_model

ROOT = Path(__file__).resolve().parent.parent

#: Where the child waits: (module, function) wrapped to print READY and sleep after (or before) running.
STEPS = {
    "passes": ("k3opt.pipeline.manager", "PassManager.run", "before"),
    "writing the data file": ("k3opt.modelio.saving", "_write_external", "after"),
    "writing the model file": ("k3opt.modelio.saving", "_write_serialized", "after"),
    "after the rename": ("k3opt.modelio", "forget_deferred", "before"),
}

HARNESS = textwrap.dedent("""
    import importlib, sys, time
    module, attr, when = sys.argv[1:4]
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    real = getattr(owner, name)

    def wait():
        print("READY", flush=True)
        time.sleep(120)

    def wrapped(*args, **kwargs):
        if when == "before":
            wait()
        out = real(*args, **kwargs)
        if when == "after":
            wait()
        return out

    setattr(owner, name, wrapped)
    if module == "k3opt.modelio":
        import k3opt.api
        k3opt.api.modelio = owner
    sys.argv = ["k3opt"] + sys.argv[4:]
    from k3opt.entry import main
    main()
""")


def weights_model() -> onnx.ModelProto:
    """Big enough (4 MiB) that the save writes a data file with --external-data."""
    w = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    return make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", TensorProto.FLOAT, [2, 1024])],
                      [("y", TensorProto.FLOAT, [2, 1024])], {"w": w})


def start(step: str, args: list[str], cwd: Path) -> subprocess.Popen:
    module, attr, when = STEPS[step]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", HARNESS, module, attr, when, *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        raise AssertionError(f"child never reached {step}: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    return proc


def stop(proc: subprocess.Popen, sig: int) -> tuple[int, str]:
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.fixture
def folder(tmp_path) -> Path:
    onnx.save(weights_model(), tmp_path / "m.onnx")
    return tmp_path


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
@pytest.mark.parametrize("step", ["passes", "writing the data file", "writing the model file"])
def test_a_stop_signal_leaves_nothing(folder, step, sig):
    proc = start(step, ["optimize", "m.onnx", "o.onnx", "--external-data", "--report", "r.json", "-q"], folder)
    code, err = stop(proc, sig)
    assert code == 2, err
    assert err == f"k3opt: error: interrupted ({signal.Signals(sig).name}); nothing was written\n"
    assert names(folder) == ["m.onnx"]


def test_a_signal_after_the_rename_does_not_say_nothing_was_written(folder):
    proc = start("after the rename", ["optimize", "m.onnx", "o.onnx", "-q"], folder)
    code, err = stop(proc, signal.SIGINT)
    assert code == 2, err
    assert err == "k3opt: error: interrupted (SIGINT) after writing o.onnx; the run did not finish\n"
    assert "o.onnx" in names(folder)
    onnx.checker.check_model(str(folder / "o.onnx"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_importing_is_one_line(tmp_path, sig):
    """The handlers are in place before the heavy imports (k3opt.entry): no KeyboardInterrupt traceback."""
    script = textwrap.dedent("""
        import sys, time
        class Stall:
            def find_spec(self, name, path=None, target=None):
                if name == "k3opt.cli":
                    print("READY", flush=True)
                    time.sleep(120)
                return None
        sys.meta_path.insert(0, Stall())
        sys.argv = ["k3opt", "--help"]
        from k3opt.entry import main
        main()
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    code, err = stop(proc, sig)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == [
        f"k3opt: error: interrupted ({signal.Signals(sig).name}) while starting; nothing was written"]


#: What a native extension raises when ``ulimit -v`` stops it mid-import, by where the limit falls (and the
#: machine's load moves where it falls): each must be the one start-up line.
IMPORT_FAILURES = {
    "ImportError": 'ImportError("libonnx.so: failed to map segment from shared object")',
    "MemoryError": "MemoryError()",
    "SystemError": 'SystemError("initialization of _multiarray_umath raised unreported exception")',
    "OSError": 'OSError(12, "Cannot allocate memory")',
    "AttributeError": "AttributeError(\"partially initialized module 'numpy' has no attribute 'dtype'\")",
    "RuntimeError": 'RuntimeError("pthread_create failed")',
}


@pytest.mark.parametrize("kind", sorted(IMPORT_FAILURES))
def test_an_import_failure_is_one_line(tmp_path, kind):
    """``ulimit -v`` too low, or a broken install: whatever an import raises while starting is one line, exit 2."""
    script = textwrap.dedent(f"""
        import sys
        class Broken:
            def find_spec(self, name, path=None, target=None):
                if name == "onnx":
                    raise {IMPORT_FAILURES[kind]}
                return None
        sys.meta_path.insert(0, Broken())
        sys.argv = ["k3opt", "optimize", "m.onnx"]
        from k3opt.entry import main
        main()
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"k3opt: error: cannot start: {kind}"), lines


def test_a_killed_save_is_cleaned_up_by_the_next_run(folder):
    proc = start("writing the data file", ["optimize", "m.onnx", "o.onnx", "--external-data", "-q"], folder)
    stop(proc, signal.SIGKILL)
    left = temp_folders(folder / "o.onnx")
    assert len(left) == 1 and (left[0] / "o.onnx.data").is_file()  # what SIGKILL leaves
    proc = subprocess.run([sys.executable, "-m", "k3opt", "optimize", "m.onnx", "o.onnx", "-q"], cwd=folder,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert names(folder) == ["m.onnx", "o.onnx"]


def test_a_live_writers_folder_is_never_removed(tmp_path):
    out = tmp_path / "o.onnx"
    live, dead, making = (tmp_path / f".o.onnx.{n}" for n in ("live.tmp", "dead.tmp", "making.new"))
    for d in (live, dead, making):
        d.mkdir()
        (d / "o.onnx.data").write_bytes(b"x")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a writer in another process holds it
    try:
        # a lock held by this process is still "held" for a new open file description: run the cleaner elsewhere
        code = ("import sys; from pathlib import Path; from k3opt.modelio.temp_folders import remove_dead; "
                "print(sorted(p.name for p in remove_dead(Path(sys.argv[1]))))")
        proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert proc.stdout.strip() == "['.o.onnx.dead.tmp']", proc.stderr
        assert live.is_dir() and making.is_dir() and not dead.exists()
    finally:
        os.close(fd)
    assert remove_dead(out) == [live]  # its writer gone, the next save removes it
    assert making.is_dir()  # not locked yet by a writer being born: never touched


#: Lines native code prints on stderr when memory runs out, which no Python code can catch or silence: the
#: interpreter failing to report an ignored exception, glibc aborting a thread, OpenBLAS giving up, onnx's
#: operator registry (which may then crash). Where one aborts the process, the exit status is the native one,
#: and what glibc prints on the way (``double free or corruption``) is set aside as well.
NATIVE = ("Exception ignored on building sys.unraisablehook arguments", "MemoryError",
          "cannot allocate memory for thread-local data", "libgcc_s.so.1 must be installed", "OpenBLAS",
          "Schema error: ")


@pytest.mark.parametrize("megabytes", [150, 160, 200, 230, 250, 300])
@pytest.mark.parametrize("verify_flag", ["--verify", "--no-verify"])
def test_a_memory_limit_is_one_line_and_blames_no_model(tmp_path, megabytes, verify_flag):
    """``ulimit -v``: wherever memory runs out (imports, onnxruntime's library, its threads), exit 0 or 2 with
    one line of k3opt's, never a traceback, never "the input/optimized model does not load", nothing left.

    Where the limit falls moves with the machine's load (glibc's malloc arenas, threads): the limits span
    the imports, onnxruntime's session and the run, and the deterministic tests above cover each kind of
    import failure. Lines native code prints (:data:`NATIVE`) are not k3opt's and are set aside.
    """
    import resource

    onnx.save(make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", TensorProto.FLOAT, [2, 8])],
                         [("y", TensorProto.FLOAT, [2, 8])]), tmp_path / "m.onnx")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (megabytes << 20, megabytes << 20))

    proc = subprocess.run([sys.executable, "-m", "k3opt", "optimize", "m.onnx", "o.onnx", "-q", verify_flag],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          preexec_fn=limit, timeout=300)
    assert "Traceback" not in proc.stderr and not proc.stdout.strip(), proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    crashed = proc.returncode < 0  # killed by a signal native code raised (glibc's abort on a corrupted heap...)
    ours = [line for line in lines if not line.startswith(NATIVE) and (line.startswith("k3opt:") or not crashed)]
    crashed = crashed or len(ours) < len(lines)  # or native code printed why it gave up
    assert proc.returncode in (0, 2) or crashed, (proc.returncode, proc.stderr)
    if proc.returncode:
        assert len(ours) == 1 or crashed and not ours, proc.stderr
        assert all(line.startswith("k3opt: error: ") for line in ours), proc.stderr
        assert not any("does not load" in line or "differs" in line for line in ours), proc.stderr
        if crashed:  # as after SIGKILL: the next save of the output removes what the dead run left
            remove_dead(tmp_path / "o.onnx")
        assert names(tmp_path) == ["m.onnx"]


def test_a_command_run_in_process_puts_the_handlers_back(tmp_path):
    """A test or a benchmark calling the CLI keeps its own SIGTERM handling afterwards."""
    from tests.test_bad_input import invoke

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    invoke(["optimize", str(tmp_path / "missing.onnx")])
    assert {s: signal.getsignal(s) for s in before} == before
