"""tests/launch.py answers as `subprocess.run` of a fresh interpreter does: exit codes, streams, stdin, environment,
working directory, atexit handlers and uncaught exceptions; the CLI tests that use it rely on each of these."""

import subprocess
import sys

import pytest

from launch import run_python

SCRIPT = """
import atexit, os, sys
atexit.register(lambda: print("atexit ran", file=sys.stderr))
data = sys.stdin.read()
print("in:", data.upper(), "env:", os.environ.get("LAUNCH_PROBE"), "cwd:", os.path.basename(os.getcwd()))
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "code":
    sys.exit(3)
if how == "message":
    sys.exit("a message")
if how == "raise":
    raise ValueError("boom")
"""


@pytest.mark.parametrize("how", ["zero", "code", "message", "raise"])
def test_run_python_answers_as_a_fresh_interpreter(tmp_path, how):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    (tmp_path / "here").mkdir()
    env = {"LAUNCH_PROBE": "yes", "PATH": "/usr/bin:/bin"}
    ours = run_python([str(script), how], env=env, cwd=tmp_path / "here", input="hello")
    real = subprocess.run([sys.executable, str(script), how], env=env, cwd=tmp_path / "here", input="hello",
                          capture_output=True, text=True)
    assert ours.returncode == real.returncode == {"zero": 0, "code": 3, "message": 1, "raise": 1}[how]
    assert ours.stdout == real.stdout == "in: HELLO env: yes cwd: here\n"
    assert ours.stderr.splitlines()[0] == "to stderr" and ours.stderr.splitlines()[-1] == "atexit ran"
    if how == "raise":  # the interpreter's traceback, then atexit
        assert "Traceback" in ours.stderr and "ValueError: boom" in ours.stderr.splitlines()[-2]
    assert [line for line in ours.stderr.splitlines() if not line.startswith("  ")] == \
        [line for line in real.stderr.splitlines() if not line.startswith("  ")]


def test_run_python_runs_modules_with_bytes_and_times_out(tmp_path):
    ours = run_python(["-m", "json.tool"], input=b'{"a": 1}', text=False, cwd=tmp_path)
    assert ours.returncode == 0 and ours.stdout == b'{\n    "a": 1\n}\n' and ours.stderr == b""
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_python([str(sleeper)], timeout=1)
