"""runtime=distributed from the command line: `spd-infer generate runtime=distributed` (spawns the stage processes)
and `torchrun ... infer/run.py` (one node, and two nodes on loopback) give runtime=local's tokens; bad input is
one line and exit 2 before any process is started; a sampled run through it keeps the target's distribution."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from spd.models.checkpoint import save_checkpoint
from spd.models.module import SpeculationModule
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget
from launch import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
COMMON = ["target=tiny-llama", "prompt=What is 12*7?", "max_new_tokens=24", "json=true", "threads_per_stage=1"]


def spd_infer(*args, timeout=240):
    return run_python(["-m", "spd.cli", "generate", *args], timeout=timeout, cwd=ROOT)


# Every process this test worker starts carries this tag in its environment (stage processes inherit it), so the
# checks below see only this worker's stage processes, not those of tests running beside it (pytest-xdist).
TAG = f"SPD_TEST_TAG={os.getpid()}"
os.environ["SPD_TEST_TAG"] = str(os.getpid())


def stage_workers() -> set[int]:
    """pids of live stage processes (spawned by spd-infer) that this test worker's commands started."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spd.runtime.distributed.worker" not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if TAG.encode() in f.read().split(b"\0"):
                    found.add(int(pid))
        except OSError:
            pass
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def local_tokens():
    out = spd_infer(*COMMON, "n=3")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["token_ids"]


@pytest.mark.parametrize("controller, processes", [("first_stage", 3), ("own_process", 4)])
def test_spawned_pipeline_equals_local(local_tokens, controller, processes):
    before = stage_workers()
    out = spd_infer(*COMMON, "n=3", "runtime=distributed", f"controller={controller}")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["token_ids"] == local_tokens and result["runtime"] == "distributed"
    assert result["processes"] == processes
    ar = spd_infer(*COMMON, "n=3", "runtime=distributed", "method=ar", f"controller={controller}")
    assert json.loads(ar.stdout)["token_ids"] == local_tokens
    assert stage_workers() <= before  # no stray process


@pytest.mark.parametrize("n", [3, 4])
def test_torchrun_two_nodes_on_loopback_equal_local(local_tokens, n):
    """The torchrun entry point, spanning two "nodes" (two torchrun commands, 2 processes each) on this machine:
    n = 3 stage processes and the controller, or n = 4 with the controller running stage 1."""
    nodes = 2
    port = free_port()
    per_node = 4 // nodes
    commands = [[TORCHRUN, f"--nnodes={nodes}", f"--node-rank={rank}", f"--nproc-per-node={per_node}",
                 "--master-addr=127.0.0.1", f"--master-port={port}", os.path.join(ROOT, "infer", "run.py"),
                 *COMMON, f"n={n}"] for rank in range(nodes)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for cmd in commands]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err
    assert json.loads(outputs[0][0].strip().splitlines()[-1])["token_ids"] == local_tokens


def one_line_exit_2(out, *words):
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spd-infer: error:"), out.stderr
    for word in words:
        assert word in lines[0], lines[0]
    assert out.stdout == ""


def test_bad_input_is_one_line_and_starts_no_process(tmp_path, capsys):
    """In this process (`main`, what the console script calls), not one interpreter per case: the refusals come
    before any stage process or model load, and the exit code and the one line are main's."""
    from types import SimpleNamespace

    from spd.cli import main

    def spd_infer(*args):
        code = main(["generate", *args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    before = stage_workers()
    one_line_exit_2(spd_infer(*COMMON, "runtime=threads"), "runtime='threads'", "local, distributed")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        one_line_exit_2(spd_infer(*COMMON, "runtime=distributed", f"master_port={port}"), f"master_port={port}",
                        "in use")
    one_line_exit_2(spd_infer(*COMMON, "runtime=distributed", "master_addr=192.0.2.1"), "192.0.2.1")
    one_line_exit_2(spd_infer(*COMMON, "runtime=distributed", "master_addr=no-such-host.invalid"), "not a known host")
    # a module trained for the even split [0, 5, 10] refuses other bounds, naming the ones it needs
    loaded = load_target("tiny-llama")
    module = SpeculationModule.from_target(StagedTarget(loaded.model, 2), 1)
    save_checkpoint(module, loaded, str(tmp_path / "ckpt"))
    one_line_exit_2(spd_infer(*COMMON, "runtime=distributed", f"checkpoint={tmp_path / 'ckpt'}", "stage_bounds=[3]"),
                    "stage_bounds=[0, 5, 10]")
    one_line_exit_2(spd_infer(*COMMON, "runtime=distributed", "threads_per_stage=0"), "threads_per_stage")
    one_line_exit_2(spd_infer(*COMMON, "runtime=distributed", "controller=stage0"), "controller='stage0'",
                    "first_stage")
    one_line_exit_2(spd_infer(*COMMON, "runtime=distributed", "n=1", "controller=first_stage"), "n >= 2")
    assert stage_workers() <= before


def test_eval_through_the_distributed_runtime(tmp_path, untied_target_dir):
    """`spd-infer eval runtime=distributed`: one set of stage processes decodes every sample, each the same as
    runtime=local's step-by-step runtime (itself checked against AR on every sample). No AR runs between the samples
    (ar_baseline=false): an AR decode over the same prompt used to hide a crop left over from the previous sample."""
    common = ["eval", f"target={untied_target_dir}", "n=2", "limit=2", "max_new_tokens=40", "wandb.mode=disabled",
              "calibrate=false", f"trace_cache_dir={tmp_path / 'traces'}", "checkpoint=random",
              "draft_source=lookup+module"]     # both draft sources: the lookup's where the context repeats
    rows = {}
    for runtime in ("local", "distributed"):
        out = tmp_path / runtime
        extra = ["exact_trace=true"] if runtime == "local" else ["threads_per_stage=1", "ar_baseline=false"]
        done = run_python(["-m", "spd.cli", *common, f"runtime={runtime}", f"output_dir={out}", *extra], timeout=300)
        assert done.returncode == 0, done.stderr
        with open(out / "samples.jsonl") as f:
            rows[runtime] = [json.loads(line) for line in f]
    assert len(rows["distributed"]) == 6
    for mine, theirs in zip(rows["distributed"], rows["local"]):
        assert (mine["text"], mine["K"], mine["rollbacks"], mine["sources"]) == (theirs["text"], theirs["K"],
                                                                                 theirs["rollbacks"], theirs["sources"])
        assert mine["runtime"] == "distributed" and theirs["ar_match"] is True
    assert sum(row["rollbacks"] for row in rows["local"]) > 0
    assert sum(row["sources"].get("lookup", [0])[0] for row in rows["local"]) > 0


def test_chat_turns_through_the_distributed_runtime_equal_local(untied_target_dir):
    """A chat's second turn (a longer prompt) after a first answer that ended on a correction (tests/test_reuse.py)."""
    turns = "Hi.\nPlease write a long detailed paragraph about foxes, then list five of them.\nAnd dogs?\n"
    answers = {}
    for runtime in ("local", "distributed"):
        proc = run_python(["-m", "spd.cli", "chat", f"target={untied_target_dir}", "n=2", "checkpoint=random",
                           "max_new_tokens=16", "json=true", f"runtime={runtime}", "threads_per_stage=1"],
                          input=turns, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        answers[runtime] = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert len(answers["local"]) == 3
    assert [a["token_ids"] for a in answers["distributed"]] == [a["token_ids"] for a in answers["local"]]
    assert [a["K"] for a in answers["distributed"]] == [a["K"] for a in answers["local"]]


def start_generation(*args):
    """spd-infer generate at n = 2 with the controller running stage 1 (what two cores get) in a new session (as a
    terminal's foreground group), once its stage process exists. Returns (the process, the stage pids that were
    there before it)."""
    before = stage_workers()
    proc = subprocess.Popen([sys.executable, "-m", "spd.cli", "generate", *args, "n=2", "runtime=distributed",
                             "controller=first_stage", "threads_per_stage=1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 180
    while len(stage_workers() - before) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc, before


def test_ctrl_c_while_the_stages_load_stops_every_process():
    """Ctrl-C before the stage processes have joined the group (they are still importing torch): the controller
    must not wait in the group's rendezvous (its timeout is a day) but exit at once."""
    import signal

    proc, before = start_generation("target=tiny-llama", "prompt=Hi", "max_new_tokens=8")
    time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and err.strip().splitlines() == ["spd-infer: interrupted"], err
    time.sleep(1)
    assert stage_workers() <= before


def test_a_stage_killed_before_joining_is_named():
    import signal

    proc, before = start_generation("target=tiny-llama", "prompt=Hi", "max_new_tokens=8")
    victim = max(stage_workers() - before)
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, err
    assert lines[0].startswith("spd-infer: error: stage ") and "was killed by SIGKILL" in lines[0], err
    time.sleep(1)
    assert stage_workers() <= before


@pytest.mark.slow
def test_ctrl_c_stops_every_process():
    """SIGINT to the whole foreground group (a terminal's Ctrl-C) mid-generation: one line, exit 130, no process left."""
    import signal

    proc, before = start_generation("prompt=Write a long story about a dragon.", "max_new_tokens=400")
    time.sleep(8)  # loaded and decoding (400 tokens take far longer than this)
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and err.strip().splitlines() == ["spd-infer: interrupted"], err
    time.sleep(1)
    assert stage_workers() <= before
