"""Run the suite's entry points (`python -m spd.cli ...`, `python train/run.py ...`) as processes of their own,
without paying the interpreter's ~7 s of torch + transformers imports on every call.

A multiprocessing forkserver imports torch and transformers once per test worker; every run is a fresh fork of it
that sets the given environment, working directory and argv, runs the entry point as `__main__` the way the
interpreter does (exit code from SystemExit, uncaught exception -> traceback and 1, atexit handlers at the end) with
stdin/stdout/stderr on files, and exits. The result is a `subprocess.CompletedProcess`, so a test reads exactly what
it read from `subprocess.run`. Interactive runs (pipes read while the process lives, signals) keep subprocess.Popen.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile

# Imported once in the forkserver: a cold `python -m spd.cli` spends almost all of its ~7 s importing these.
PRELOAD = ["torch", "transformers", "transformers.models.llama.modeling_llama", "spd.targets.stages",
           "spd.engine", "spd.cli.generate", "launch"]
_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _child(argv: list[str], env: dict, cwd: str, stdin_path: str, out_path: str, err_path: str) -> None:
    import atexit
    import runpy
    import traceback

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path, mode in ((0, stdin_path, os.O_RDONLY), (1, out_path, os.O_WRONLY), (2, err_path, os.O_WRONLY)):
        handle = os.open(path, mode)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if env.get("OMP_NUM_THREADS"):  # the forkserver's thread pool was sized by the worker's environment, not this one
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, cwd)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if not stream.closed:  # a program may close its own stdout; the interpreter's exit then skips it too
            stream.flush()
    os._exit(code)


def _read(path: str, mode: str):
    with open(path, mode) as f:
        return f.read()


def run_python(args: list[str], *, env: dict | None = None, cwd: str | None = None,
               input: str | bytes | None = None, text: bool = True,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *args], capture_output=True, text=text, ...)` from a warm forkserver."""
    mode = "" if text else "b"
    with tempfile.TemporaryDirectory(prefix="spd-launch-") as tmp:
        paths = [os.path.join(tmp, name) for name in ("stdin", "stdout", "stderr")]
        for path, data in zip(paths, (input, None, None)):
            with open(path, "w" + mode) as f:
                f.write(data or ("" if text else b""))
        proc = _forkserver().Process(target=_child, args=(list(args), dict(os.environ if env is None else env),
                                                          os.path.abspath(cwd or os.getcwd()), *paths))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout)
        out, err = (_read(path, "r" + mode) for path in paths[1:])
    return subprocess.CompletedProcess([sys.executable, *args], proc.exitcode, out, err)
