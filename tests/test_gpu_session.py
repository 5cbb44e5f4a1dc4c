"""bench/gpu_session.py, the prepared GPU run, cannot rot: its dry run (a tiny random target on CPU) goes through
every step the GPU run takes — parts stashed and assembled, correctness rows, speed rows, a probe-planned training run
ended by SIGINT at its box with checkpoints exported as float16 parts, the fast evaluator, the returned files — and
`python -m bench.gpu_pack unpack` rebuilds the trained module from what came back."""

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def with_repo_path() -> dict:
    """The environment for `python -m bench.x` run outside the repository root (unpack writes under its cwd)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_dry")
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_session", "--device", "cpu", "--dry-run",
                           "--out", str(root / "out"), "--work", str(root / "work")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(root / "out" / "session.json") as f:
        return root, json.load(f)


def test_dry_run_goes_through_every_step(dry_run):
    _, session = dry_run
    steps = session["steps"]
    assert [steps[s]["status"] for s in ("setup", "env", "correctness", "speed", "train_n5", "eval")] == ["ok"] * 6
    rows = steps["correctness"]["rows"]
    names = {r["name"] for r in rows}
    for kind in ("local_eager", "local_graphs", "streams_eager", "streams_graphs"):
        for w in (1, 4):
            assert {f"spd_{kind}_w{w}_float32", f"spd_{kind}_w{w}_bfloat16"} <= names
    assert {"ppsd_local_eager_w1_float32", "lookup_chain_bfloat16", "eagle3_chain_float32",
            "eagle3_tree_w4_bfloat16"} <= names and len(rows) == 24
    for r in rows:
        assert r["status"] == "ok" and r["greedy_equal"] == r["prompts"] == 3, r
        assert len(r["sampled_tokens"]) == 3 and min(r["sampled_tokens"]) >= 1
    speed = steps["speed"]["runs"]["float32"]["rows"]
    for name in ("suite_ar_eager", "suite_ar_fixed_eager", "suite_ar_graphs", "spd_local_eager", "spd_local_graphs",
                 "spd_streams_eager", "spd_streams_graphs", "hf_dynamic"):
        assert speed[name]["tokens_per_s"] > 0
    spd = {name: row for name, row in speed.items() if name.startswith("spd_")}
    assert all(row.get("skipped") == "compile off" or row["ar_match"] == 3 for row in spd.values()), spd
    assert sum("ar_match" in row for row in spd.values()) >= 5
    assert steps["speed"]["runs"]["float32"]["stage_overlap"]["together_s"] > 0
    hybrid = speed["hybrid_spd_eager"]           # a random Qwen3.5: the oracle keeps the pipeline full
    assert speed["hybrid_ar_eager"]["tokens_per_s"] > 0 and hybrid["verdict"] == "equal" and hybrid["eal"] > 1
    assert speed["hybrid_ar_device_graphs"]["verdict"] == "equal"      # its states by position, on the device step
    train = steps["train_n5"]
    assert train["stopped_by_box"] and train["rc"] == 130 and train["steps_done"] >= 2     # SIGINT saved it
    assert train["probe"]["tokens_per_s"] > 0 and train["planned_steps"] >= 2
    assert train["continues"].endswith("tiny_module_n5") and f"init_from={train['continues']}" in train["command"]
    evals = {r["label"]: r for r in steps["eval"]["rows"]}
    assert set(evals) == {"random_n5", "gpu_n5"} and all(r["status"] == "ok" for r in evals.values())
    assert all(1 <= r["eal_pooled"] <= 5 and r["samples"] == 3 for r in evals.values())
    returned = session["returned"]
    assert returned["within_limits"] and len(returned["files"]) <= 8
    assert set(returned["files"]) == {"session.json", "log.txt", "rows.jsonl", *session["modules"]["n5"]["shards"]}
    assert steps["setup"]["imports"] == "ok"
    from bench.gpu_steps import read_rows

    lines = read_rows(os.path.join(dry_run[0], "out", "rows.jsonl"))       # every row, as it ended
    assert {r["step"] for r in lines} == {"env", "correctness", "speed", "eval"}
    assert sum(r["step"] == "correctness" for r in lines) == 24


def test_unpack_rebuilds_the_trained_module(dry_run, tmp_path):
    from safetensors.torch import load_file

    from spd.models.checkpoint import float16_state

    root, session = dry_run
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_pack", "unpack", str(root / "out")],
                          cwd=tmp_path, env=with_repo_path(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    module = tmp_path / "outputs" / "gpu" / session["stamp"] / "n5"
    got = load_file(module / "model.safetensors")
    trained = float16_state(load_file(root / "work" / "train_n5" / "checkpoint" / "model.safetensors"))
    assert got.keys() == trained.keys() and all(torch.equal(got[k], trained[k]) for k in got)
    config = json.loads((module / "config.json").read_text())
    assert config["n"] == 5
    # the training continued the carried module: its steps and tokens count on from that module's
    assert config["training"]["continued_from"]["path"].endswith("tiny_module_n5")
    assert config["step"] == config["training"]["continued_from"]["step"] + session["steps"]["train_n5"]["steps_done"]
    assert (tmp_path / "docs" / "results" / "gpu" / session["stamp"] / "session.json").is_file()


def test_a_failing_row_is_recorded_and_the_step_goes_on(tmp_path):
    import time

    from bench.gpu_steps import Result, guarded

    result = Result(str(tmp_path / "r.json"), "correctness")
    guarded(result, "boom", time.time() + 60, lambda: {"x": 1 / 0})
    guarded(result, "fine", time.time() + 60, lambda: {"summary": "ok"})
    guarded(result, "late", time.time() - 1, lambda: {"summary": "never run"})
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["error", "ok", "skipped"]
    assert "ZeroDivisionError" in rows[0]["traceback"]


def test_a_later_run_runs_only_the_rows_it_names():
    from bench import gpu_rows
    from bench.gpu_steps import correctness_rows

    everything = [row[0] for row in correctness_rows({"spd_checkpoint": "c"})]
    assert len(everything) == 12 and "lookup_chain" in everything
    named = correctness_rows({"spd_checkpoint": "c", "rows": ["lookup_chain", "spd_streams_graphs_w4", "hf_dynamic"]})
    assert [row[0] for row in named] == ["spd_streams_graphs_w4", "lookup_chain"]

    class Refusing:                   # transformers' generate failing as it did on the H200 on 2026-11-27
        def generate(self, *args, **kwargs):
            raise RuntimeError("accessing tensor output of CUDAGraphs that has been overwritten")

    saved, cpu = [], torch.device("cpu")
    rows = gpu_rows.run_speed(gpu_rows.hf_specs(Refusing(), 4, cpu, frozenset()), [[1, 2]], 4, cpu, {},
                              only=frozenset({"hf_dynamic"}), saved=lambda: saved.append(1))
    assert rows["hf_static_compile"] == {"skipped": "not asked"}
    assert rows["hf_dynamic"]["error"].startswith("RuntimeError: accessing tensor output") and saved == [1, 1]


def test_hf_rows_time_each_prompt_after_its_own_warm_up():
    from bench import gpu_rows

    class Recording:                  # a static cache compiles again for every new prompt length
        calls = []

        def generate(self, input_ids, max_new_tokens, **kwargs):
            self.calls.append(input_ids.shape[1])
            return torch.cat([input_ids, torch.full((1, max_new_tokens), 7)], dim=1)

    model = Recording()
    cpu = torch.device("cpu")
    rows = gpu_rows.run_speed(gpu_rows.hf_specs(model, 4, cpu, frozenset()), [[1, 2], [1, 2, 3]], 4, cpu, {},
                              only=frozenset({"hf_dynamic"}))
    assert model.calls == [2, 2, 3, 3]        # each prompt warmed, then timed
    row = rows["hf_dynamic"]
    assert row["tokens"] == 8 and row["first_call_seconds"] > 0 and row["tokens_per_s"] > 0


def test_a_run_can_give_a_step_a_longer_box(tmp_path):
    from types import SimpleNamespace

    from bench.gpu_session import BOXES, GpuRun, parse_boxes

    assert parse_boxes(["speed=300", "eval=60"]) == {"speed": 300.0, "eval": 60.0}
    for bad in ("speed", "speed=0", "speed=soon", "warmup=30"):
        with pytest.raises(ValueError, match="STEP=SECONDS"):
            parse_boxes([bad])
    args = SimpleNamespace(dry_run=False, minutes=9, out=str(tmp_path / "o"), work=str(tmp_path / "w"), device="cpu",
                           boxes=parse_boxes(["speed=300"]))
    gpu_run = GpuRun(args)
    assert gpu_run.box("speed") == 300 and gpu_run.box("eval") == BOXES["eval"][0]


def test_a_step_that_overruns_its_box_is_killed(tmp_path):
    from types import SimpleNamespace

    from bench.gpu_session import GpuRun

    gpu_run = GpuRun(SimpleNamespace(dry_run=True, minutes=1, out=str(tmp_path / "out"), work=str(tmp_path / "w"),
                                  device="cpu"))
    rc, seconds = gpu_run.run_process([sys.executable, "-c", "import time; time.sleep(60)"], 1.0)
    assert rc == "killed at its time box" and seconds < 30


def test_parts_assemble_only_when_all_are_there_and_verified(tmp_path):
    import shutil

    from bench.gpu_pack import split_payload, stash_and_assemble

    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.bin").write_bytes(os.urandom(30_000))
    (src / "y.txt").write_text("payload")
    manifest = split_payload(str(src), str(tmp_path / "pack"), 12_000)
    assert len(manifest["parts"]) >= 3
    stash = tmp_path / "stash"
    for i, part in enumerate(manifest["parts"]):
        call = tmp_path / f"call{i}"
        shutil.copytree(tmp_path / "pack" / part["name"], call / part["name"])
        got = stash_and_assemble(str(call), str(stash), log=lambda m: None)
        assert (got is None) == (i < len(manifest["parts"]) - 1)
    assert (stash / "payload" / "a" / "x.bin").read_bytes() == (src / "a" / "x.bin").read_bytes()
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "pack" / "part1", bad / "part1")
    with open(bad / "part1" / "payload.tar.1", "r+b") as f:
        f.write(b"corrupted")
    with pytest.raises(RuntimeError, match="does not match"):
        stash_and_assemble(str(bad), str(tmp_path / "stash2"), log=lambda m: None)


def test_help_names_every_step_and_its_minutes():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_session", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    for step in ("setup", "correctness", "speed", "train", "eval"):
        assert step in proc.stdout
    assert "9 minutes" in proc.stdout or "(default 9)" in proc.stdout


def test_a_run_trains_eagle3_and_brings_it_home(tmp_path):
    """`--train eagle3` (configs/train/gpu_eagle3.yaml): the baseline at the shipped modules' scale on a GPU;
    its eval decodes it as EAGLE-3 (tau) and `unpack` rebuilds it as an EAGLE-3 checkpoint."""
    root = tmp_path / "gpu_run"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_session", "--device", "cpu", "--dry-run",
                           "--skip", "correctness,speed", "--train", "eagle3", "--out", str(root / "out"),
                           "--work", str(root / "work")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    session = json.loads((root / "out" / "session.json").read_text())
    train = session["steps"]["train_eagle3"]
    assert train["status"] == "ok" and "configs/train/gpu_eagle3.yaml" in train["command"]
    assert "model.n=" not in train["command"]
    evals = {r["label"]: r for r in session["steps"]["eval"]["rows"]}
    assert evals["gpu_eagle3"]["status"] == "ok" and evals["gpu_eagle3"]["metric"] == "tau_pooled"
    assert evals["gpu_eagle3"]["tau_pooled"] >= 1 and evals["random_n5"]["metric"] == "eal_pooled"
    home = tmp_path / "home"
    home.mkdir()
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_pack", "unpack", str(root / "out")],
                          cwd=home, env=with_repo_path(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    module = home / "outputs" / "gpu" / session["stamp"] / "eagle3"
    assert json.loads((module / "config.json").read_text())["method"] == "eagle3"
    assert (module / "model.safetensors").is_file()


def test_a_rehearsal_keeps_every_row_through_a_failure_a_short_box_and_a_resume(tmp_path, monkeypatch):
    """bench/gpu.py's rows on CPU: a row made to fail records its error, rows the box cannot hold are skipped with
    their estimate, every other row is measured and in the JSON the moment it ends; the untimed pass builds every
    step (nothing is captured or compiled while timed) and gives the verdict against the fixed-shape AR; a second
    call keeps the saved rows and runs none of them again."""
    import time

    from bench import gpu, gpu_rows
    from spd.config import GenerateConfig, load_config
    from spd.runtime.device_chain import DeviceChainDecoder
    from spd.session import open_session

    class Failing(gpu_rows.SelfDraftDrafter):
        def start(self, *args, **kwargs):
            raise RuntimeError("a row made to fail")
    monkeypatch.setattr(gpu_rows, "SelfDraftDrafter", Failing)
    session = open_session(load_config(GenerateConfig, None, ["target=tiny-llama", "method=spd", "checkpoint=random",
                                                              "n=3"]))
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
    path = tmp_path / "speed.json"
    rows, seen = {}, []

    def saved():
        path.write_text(json.dumps(rows))
        seen.append(len(rows))
    # a box too short for the compiled rows (last): priced at 1,000 s a compile, a 600 s box cannot hold them
    monkeypatch.setitem(gpu.COSTS, "cpu", {**gpu.COSTS["cpu"], "compiled": (1000.0, 0.01)})
    cpu = torch.device("cpu")
    gpu_rows.run_speed(gpu_rows.suite_specs(session, 6, cpu)[0], prompts, 6, cpu, rows, saved,
                       deadline=time.time() + 600, compile=True)
    on_disk = json.loads(path.read_text())
    assert on_disk.keys() == rows.keys() and seen == list(range(1, len(rows) + 1))    # saved after every row
    failed = {k for k, v in on_disk.items() if "error" in v}
    assert failed == {"selfdraft_chain", "selfdraft_device_graphs"}
    assert all("a row made to fail" in on_disk[k]["error"] for k in failed)
    skipped = {k: v for k, v in on_disk.items() if "skipped" in v}
    assert set(skipped) == set(gpu.COMPILED) and all(v["skipped"] == "time box" and v["estimate_s"] > v["left_s"]
                                                     for v in skipped.values())
    measured = {k: v for k, v in on_disk.items() if "tokens_per_s" in v}
    assert len(measured) == len(rows) - len(failed) - len(skipped) >= 15
    for name, row in measured.items():
        assert row["steps_built_while_timed"] == 0 and row["repeatable"], name
        if name != "suite_ar_fixed_eager":
            assert row["verdict"] == "equal" and row["ar_match"] == 2, (name, row)
    assert measured["suite_ar_device_graphs"]["steps_built"] >= 1       # built in the untimed pass
    # a second call resumes: the saved rows are kept, nothing decodes again
    calls = []
    monkeypatch.setattr(DeviceChainDecoder, "generate", lambda *a, **k: calls.append(1))
    again = json.loads(path.read_text())
    gpu_rows.run_speed(gpu_rows.suite_specs(session, 6, cpu)[0], prompts, 6, cpu, again, compile=False)
    assert not calls and all(again[k].get("resumed") for k in measured) and \
        all(again[k] == {"skipped": "compile off"} for k in gpu.COMPILED)


def test_a_verdict_tells_exact_ties_from_mismatches():
    from bench.gpu import verdict

    ref, prompts = [[1, 2, 3], [4, 5, 6]], [[0], [0]]
    margins = {(0, 1, 2): 0.0, (0, 4): 0.25}
    assert verdict(ref, ref, prompts, lambda ids: 1.0)["verdict"] == "equal"
    tie = verdict([[1, 2, 9], [4, 5, 6]], ref, prompts, lambda ids: margins[tuple(ids)])
    assert tie["verdict"] == "ties" and tie["differences"] == [
        {"prompt": 0, "position": 2, "row_tokens": [9], "ar_tokens": [3], "top2_margin": 0.0, "exact_tie": True}]
    bad = verdict([[1, 2, 9], [4, 7, 6]], ref, prompts, lambda ids: margins[tuple(ids)])
    assert bad["verdict"] == "invalid" and bad["ar_match"] == 0 and bad["differences"][1]["top2_margin"] == 0.25


HANGING_STEP = """
import sys, time
from bench import gpu, gpu_steps
real, done, k = gpu.measure, [], int(sys.argv[1])
def measure(*args, **kwargs):      # row k + 1 never ends: the command limit kills the step in it
    if len(done) == k:
        time.sleep(3600)
    done.append(1)
    return real(*args, **kwargs)
gpu.measure = measure
sys.exit(gpu_steps.main(sys.argv[2:]))
"""


def speed_plan(tmp_path, name: str, rows=None, resume=None) -> str:
    from bench.gpu_session import DRY_HYBRID

    out, work = tmp_path / name / "out", tmp_path / name / "work"
    out.mkdir(parents=True), work.mkdir(parents=True)
    plan = {"device": "cpu", "target": "tiny-llama", "spd_checkpoint": "random", "eagle3_checkpoint": None,
            "rows": rows, "resume": resume, "work": str(work), "out": str(out), "stamp": name,
            "speed": {"dtypes": ["float32"], "prompts_per_set": 1, "max_new_tokens": 6, "compile": False,
                      "copy_mib": 1, "hybrid_shape": DRY_HYBRID}}
    path = tmp_path / name / "plan.json"
    path.write_text(json.dumps(plan))
    return str(path)


def test_a_killed_speed_step_leaves_its_rows_in_out_and_the_next_call_resumes_from_them(tmp_path):
    """Rows reach $OUT/rows.jsonl the moment each ends: a step killed inside row k + 1 has rows 1..k there, the
    baseline first; `gpu_pack resume` puts that file where a call carries it, and a call resuming from it keeps those
    rows, measures only the rest, and gives them verdicts against the resumed reference's outputs."""
    import time

    from bench.gpu_steps import read_rows

    asked = ["lookup_device_graphs", "suite_ar_eager", "hf_static_compile", "suite_ar_device_graphs",
             "hybrid_ar_device_graphs"]
    plan = speed_plan(tmp_path, "first", asked)
    out = tmp_path / "first" / "out" / "rows.jsonl"
    env = {**with_repo_path(), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", HANGING_STEP, "2", "speed", "--plan", plan, "--result",
                             str(tmp_path / "first" / "speed.json")], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        give_up = time.time() + 240
        while time.time() < give_up and proc.poll() is None and len(read_rows(out) if out.exists() else []) < 3:
            time.sleep(0.5)
        time.sleep(1.0)
    finally:
        proc.kill()
        log = proc.communicate()[0].decode()[-3000:]
    records = read_rows(out)
    # the reference, then the baseline (transformers' compiled static cache, skipped here: compile off), then the
    # suite's AR through the device step; the kill came inside the third measured row
    assert [(r["step"], r["dtype"], r["name"]) for r in records] == [
        ("speed", "float32", "suite_ar_fixed_eager"), ("speed", "float32", "hf_static_compile"),
        ("speed", "float32", "suite_ar_device_graphs")], log
    assert records[1]["row"] == {"skipped": "compile off"} and records[2]["row"]["verdict"] == "equal"
    assert all(len(o) == 6 for o in records[0]["row"]["outputs"])
    # what travels: the returned rows.jsonl, carried as .gpu/resume/ (docs/ does not travel)
    home = tmp_path / "home"
    home.mkdir()
    proc2 = subprocess.run([sys.executable, "-m", "bench.gpu_pack", "resume", str(out)], cwd=home,
                           env=with_repo_path(), capture_output=True, text=True, timeout=60)
    assert proc2.returncode == 0 and "--resume .gpu/resume/rows.jsonl" in proc2.stdout, proc2.stderr
    plan2 = speed_plan(tmp_path, "second", asked, resume=str(home / ".gpu" / "resume" / "rows.jsonl"))
    proc3 = subprocess.run([sys.executable, "-c", HANGING_STEP, "100", "speed", "--plan", plan2, "--result",
                            str(tmp_path / "second" / "speed.json")], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)
    assert proc3.returncode == 0, proc3.stdout[-3000:] + proc3.stderr[-3000:]
    rows = json.loads((tmp_path / "second" / "speed.json").read_text())["runs"]["float32"]["rows"]
    assert rows["suite_ar_fixed_eager"]["resumed"] and rows["suite_ar_device_graphs"]["resumed"]
    for name in ("lookup_device_graphs", "suite_ar_eager"):       # measured now, checked against the resumed AR
        assert rows[name]["verdict"] == "equal" and rows[name]["reference"] == "suite_ar_fixed_eager", rows[name]
    assert rows["hybrid_ar_device_graphs"]["verdict"] == "equal"   # its reference came along (hybrid_ar_eager)
    again = [r["name"] for r in read_rows(tmp_path / "second" / "out" / "rows.jsonl")]
    assert "suite_ar_fixed_eager" not in again and {"lookup_device_graphs", "suite_ar_eager"} <= set(again)


def test_the_baseline_rows_come_first_and_every_reference_before_its_rows():
    from bench import gpu_rows
    from spd.config import GenerateConfig, load_config
    from spd.session import open_session

    session = open_session(load_config(GenerateConfig, None, ["target=tiny-llama", "method=spd", "checkpoint=random",
                                                              "n=3"]))
    specs, _ = gpu_rows.speed_specs(session, 4, torch.device("cpu"), torch.float32)
    order = [spec.name for spec in gpu_rows.speed_order(specs)]
    assert order[:3] == ["suite_ar_fixed_eager", "hf_static_compile", "suite_ar_device_graphs"]
    assert len(order) == len(set(order)) == len(specs)
    compiled = [spec.name for spec in specs if spec.compiled and spec.name != "hf_static_compile"]
    assert set(order[-len(compiled):]) == set(compiled)          # minutes of compilation each: last
    assert order[-len(compiled):][:2] == ["suite_ar_device_compiled_graphs", "default_device_compiled_graphs"]
    position = {name: i for i, name in enumerate(order)}
    for spec in specs:
        if spec.reference:
            assert position[spec.reference] < position[spec.name], spec.name
    assert order.index("eagle3_tree_device_graphs") < order.index("lookup_chain") < order.index("spd_local_eager")


def test_nothing_is_built_for_a_row_not_run_and_a_failing_build_is_that_rows_error(monkeypatch):
    from bench import gpu_rows
    from spd.config import GenerateConfig, load_config
    from spd.session import open_session

    import transformers

    session = open_session(load_config(GenerateConfig, None, ["target=tiny-llama", "method=spd", "checkpoint=random",
                                                              "n=3"]))
    built = []

    def refusing_model(*args, **kwargs):        # the hybrid's random Qwen3.5 at the 4B's shape
        built.append(1)
        raise MemoryError("a 4B model does not fit")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refusing_model)
    cpu = torch.device("cpu")
    specs, _ = gpu_rows.speed_specs(session, 4, cpu, torch.float32)
    rows = gpu_rows.run_speed(specs, [[5, 6, 7]], 4, cpu, {}, only=frozenset({"suite_ar_device_graphs"}))
    assert not built and rows["hybrid_ar_eager"] == {"skipped": "not asked"}
    assert rows["suite_ar_device_graphs"]["verdict"] == "equal"
    rows = gpu_rows.run_speed(specs, [[5, 6, 7]], 4, cpu, {}, only=frozenset({"hybrid_spd_eager", "suite_ar_eager"}))
    hybrid = rows["hybrid_ar_eager"]
    assert hybrid["error"].startswith("MemoryError: a 4B model") and "traceback" in hybrid
    assert rows["hybrid_spd_eager"]["error"].startswith("MemoryError")      # each row its own error
    assert rows["suite_ar_eager"]["verdict"] == "equal" and len(rows) == len(specs)


def test_the_compiled_and_captured_rows_decode_as_ar_through_their_eager_twin(monkeypatch):
    """Inductor's code captured in the suite's CUDA graph (`*_compiled_graphs`): built with compile and cuda_graphs
    both on; on a CPU there is no graph, and with the compiler's backend swapped for none the same rows run the same
    step eagerly: greedy = the fixed-shape AR."""
    from bench import gpu_rows
    from spd.config import GenerateConfig, load_config
    from spd.runtime.device_chain import DeviceChainDecoder
    from spd.session import open_session

    names = ("suite_ar_device_compiled_graphs", "default_device_compiled_graphs")
    made = []
    real = DeviceChainDecoder.__init__

    def recording(self, *args, **kwargs):
        made.append((kwargs.get("compile"), kwargs.get("cuda_graphs")))
        real(self, *args, **{**kwargs, "compile": None})       # the eager twin
    monkeypatch.setattr(DeviceChainDecoder, "__init__", recording)
    session = open_session(load_config(GenerateConfig, None, ["target=tiny-llama", "method=spd", "checkpoint=random",
                                                              "n=3"]))
    cpu = torch.device("cpu")
    specs, _ = gpu_rows.speed_specs(session, 6, cpu, torch.float32, hybrid=False)
    rows = gpu_rows.run_speed(specs, [[5, 6, 7, 8], [9, 10, 11, 12, 13]], 6, cpu, {}, only=frozenset(names))
    assert made == [("inductor", True)] * 2
    for name in names:
        assert rows[name]["verdict"] == "equal" and rows[name]["ar_match"] == 2, rows[name]


def fake_run(tmp_path, monkeypatch, steps: dict, **args):
    """A GpuRun whose steps run in this process: `steps[name](argv)` for each, the others a finished empty step."""
    from types import SimpleNamespace

    from bench import gpu_session

    defaults = dict(dry_run=True, minutes=10, out=str(tmp_path / "out"), work=str(tmp_path / "work"), device="cpu",
                    skip="", train="", rows="", resume=None, boxes={})
    run = gpu_session.GpuRun(SimpleNamespace(**{**defaults, **args}))

    def setup():
        run.plan = speed_plan(tmp_path, "plan")
        run.plan_path = run.plan
        with open(run.plan) as f:
            run.plan = json.load(f)
        run.plan["eval"] = {}
        return True

    def run_process(argv, timeout):
        name, result = argv[3], argv[argv.index("--result") + 1]
        if name in steps:
            return steps[name](argv[3:]), 1.0
        rows = [{"name": "target_weight_cache", "status": "ok"}] if name == "env" else []
        with open(result, "w") as f:
            json.dump({"step": name, "rows": rows, "finished": True}, f)
        return 0, 1.0
    monkeypatch.setattr(run, "setup", setup)
    monkeypatch.setattr(run, "run_process", run_process)
    return run


def test_a_failing_pre_row_build_is_the_steps_error_and_the_other_steps_still_run(tmp_path, monkeypatch):
    from bench import gpu_steps

    def no_session(*args, **kwargs):
        raise RuntimeError("the target's weights are not there")
    monkeypatch.setattr(gpu_steps, "session_for", no_session)
    run = fake_run(tmp_path, monkeypatch, {"speed": gpu_steps.main})
    assert run.run() == 0
    steps = run.session["steps"]
    assert steps["speed"]["status"] == "failed" and steps["speed"]["rc"] == 1
    assert steps["speed"]["error"] == "RuntimeError: the target's weights are not there"
    assert "no_session" in steps["speed"]["traceback"]
    assert steps["correctness"]["status"] == steps["eval"]["status"] == "ok"      # before and after it
    log = (tmp_path / "work" / "log.txt").read_text()
    assert "step speed: RuntimeError: the target's weights are not there" in log


def test_after_a_failed_env_step_the_steps_that_need_it_are_skipped(tmp_path, monkeypatch):
    ran = []

    def env(argv):
        result = argv[argv.index("--result") + 1]
        with open(result, "w") as f:
            json.dump({"step": "env", "rows": [{"name": "target_weight_cache", "status": "error"}],
                       "finished": True}, f)
        ran.append("env")
        return 0
    run = fake_run(tmp_path, monkeypatch, {"env": env}, train="n5")
    assert run.run() == 1 and ran == ["env"]
    steps = run.session["steps"]
    assert {name: steps[name]["status"] for name in ("correctness", "speed", "train_n5", "eval")} == \
        dict.fromkeys(("correctness", "speed", "train_n5", "eval"), "skipped")
    assert steps["speed"]["why"] == "the target did not load (env)"


def test_eval_can_be_skipped_and_every_box_ends_by_the_minutes(tmp_path, monkeypatch):
    from bench.gpu_session import KILL_S, RESERVE_S

    run = fake_run(tmp_path, monkeypatch, {}, skip="eval", minutes=1.0, boxes={"speed": 480})
    assert run.run() == 0
    steps = run.session["steps"]
    assert "eval" not in steps and steps["speed"]["status"] == "ok"
    # a 480 s box in a one-minute run: cut so that it and its kill allowance end before the results are packed
    assert steps["speed"]["box_s"] <= 60 - KILL_S[1] - RESERVE_S[1]


def test_a_gpu_run_that_would_pass_the_command_limit_is_refused_in_one_line(capsys):
    from bench.gpu_session import main

    with pytest.raises(SystemExit) as exit:
        main(["--out", "/tmp/never", "--minutes", "10"])
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--minutes 10" in err and "600 s" in err
    with pytest.raises(SystemExit) as exit:
        main(["--out", "/tmp/never", "--resume", "/nonexistent/rows.jsonl"])
    assert exit.value.code == 2 and "--resume /nonexistent/rows.jsonl: no such file" in capsys.readouterr().err


def test_the_import_check_names_the_module_that_fails_in_one_line(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from bench import gpu_session

    run = gpu_session.GpuRun(SimpleNamespace(dry_run=True, minutes=1, out=str(tmp_path / "out"),
                                             work=str(tmp_path / "w"), device="cpu"))
    monkeypatch.setattr(gpu_session, "IMPORTS", ("json", "spd_no_such_module"))
    line = run.check_imports()
    assert line == "import spd_no_such_module: ModuleNotFoundError: No module named 'spd_no_such_module'"


def test_the_first_call_unpacks_the_wheels_from_part_1_alone(tmp_path):
    """The payload's tar begins with its wheels, so the call that carries part 1 installs them and checks every
    import before the other parts arrive."""
    import shutil

    from bench.gpu_pack import early_wheels, split_payload, stash_and_assemble

    src = tmp_path / "src"
    for rel, size in (("data/a.bin", 30_000), ("target/t.gguf", 20_000), ("wheels/x-1-py3-none-any.whl", 5_000),
                      ("wheels/y-2-py3-none-any.whl", 4_000)):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(os.urandom(size))
    manifest = split_payload(str(src), str(tmp_path / "pack"), 16_000)
    assert len(manifest["parts"]) >= 4
    stash = tmp_path / "stash"
    call = tmp_path / "call1"
    shutil.copytree(tmp_path / "pack" / "part1", call / "part1")
    assert stash_and_assemble(str(call), str(stash), log=lambda m: None) is None
    wheels = early_wheels(str(stash), log=lambda m: None)
    assert sorted(os.listdir(wheels)) == ["x-1-py3-none-any.whl", "y-2-py3-none-any.whl"]
    assert (stash / "early" / "wheels" / "y-2-py3-none-any.whl").read_bytes() == \
        (src / "wheels" / "y-2-py3-none-any.whl").read_bytes()
    assert not (stash / "early.tar").exists()
