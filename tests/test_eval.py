"""`spd-infer eval` / `report` on a tiny target: outputs, pooling, resume, fast evaluator = runtime, W&B, bad input."""

import glob
import json
import os

import pytest
import torch

from spd.models.checkpoint import save_checkpoint
from spd.methods import METHODS
from spd.cli import main
from spd.eval.traces import TraceCache, trace_key
from spd.models.module import SpeculationModule
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget

from helpers import read_wandb_offline

FIELDS = {"question_id", "dataset", "method", "n", "L_s", "T", "N", "K", "alpha", "eal", "rollbacks",
          "accepted_run_histogram", "wall_s", "tokens_per_s", "text", "seed", "mode", "ar_match"}


def run_eval(capsys, target, out, *args):
    code = main(["eval", f"target={target}", f"output_dir={out}", f"trace_cache_dir={out}-traces",
                 "max_new_tokens=12", "wandb.mode=disabled", *args])
    _, err = capsys.readouterr()
    return code, err


def samples(out):
    with open(os.path.join(out, "samples.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_greedy_eval_outputs_pooling_wandb_and_resume(capsys, tiny_target_dir, tmp_path):
    out = str(tmp_path / "ev")
    code, err = run_eval(capsys, tiny_target_dir, out, "n=3", "limit=2", "wandb.mode=offline")
    assert code == 0, err
    rows = samples(out)
    assert len(rows) == 6 and FIELDS <= set(rows[0]) and {r["dataset"] for r in rows} == {"mt_bench", "gsm8k", "humaneval"}
    summary = json.load(open(os.path.join(out, "summary.json")))
    for ds in ("mt_bench", "gsm8k", "humaneval", None):
        group = [r for r in rows if ds is None or r["dataset"] == ds]
        figures = summary["overall"] if ds is None else summary["datasets"][ds]
        assert figures["eal_pooled"] == pytest.approx(3 * sum(r["N"] for r in group) / sum(r["K"] for r in group))
        assert figures["eal_mean_of_ratios"] == pytest.approx(sum(r["eal"] for r in group) / len(group))
    assert summary["meta"]["config"]["n"] == 3 and summary["meta"]["dtype"] == "float32"
    assert summary["speedup"]["measured_cost"]["overall"] > 0
    table = open(os.path.join(out, "table.md")).read()
    assert "SPD (n=3, L_s=1, untrained)" in table and f"{summary['overall']['eal_pooled']:.2f}" in table
    assert os.path.getsize(os.path.join(out, "eal_per_dataset.png")) > 0
    # the offline W&B run holds the L'acc metrics
    (run_dir,) = glob.glob(os.path.join(out, "wandb", "offline-run-*"))
    logged = read_wandb_offline(run_dir, wait_for=("history", "eval/overall/eal_pooled"))
    for ds in ("mt_bench", "gsm8k", "humaneval", "overall"):
        figures = summary["overall"] if ds == "overall" else summary["datasets"][ds]
        assert logged[("history", f"eval/{ds}/eal_pooled")] == pytest.approx(figures["eal_pooled"])
    # resume: a larger limit decodes only the new prompts and keeps the old records
    code, err = run_eval(capsys, tiny_target_dir, out, "n=3", "limit=3")
    assert code == 0, err
    assert "9 prompts, 6 already done" in err
    assert samples(out)[:6] == rows and len(samples(out)) == 9
    # a different config in the same directory is refused
    code, err = run_eval(capsys, tiny_target_dir, out, "n=2", "limit=3")
    assert code == 2 and "different config" in err


@pytest.mark.parametrize("n,source", [(2, "module"), (3, "module"), (5, "module"), (3, "lookup+module")])
def test_fast_evaluator_equals_runtime_and_runtime_equals_ar(capsys, tiny_target_dir, tmp_path, n, source):
    fast, exact = str(tmp_path / "fast"), str(tmp_path / "exact")
    common = [f"n={n}", "limit=3", "calibrate=false", f"draft_source={source}"]
    assert run_eval(capsys, tiny_target_dir, fast, *common)[0] == 0
    assert run_eval(capsys, tiny_target_dir, exact, *common, "exact_trace=true")[0] == 0
    a, b = samples(fast), samples(exact)
    assert [r["mode"] for r in a] == ["fast"] * 9 and [r["mode"] for r in b] == ["runtime"] * 9
    figures = ("N", "K", "rollbacks", "text", "sources")
    assert [[r[k] for k in figures] for r in a] == [[r[k] for k in figures] for r in b]
    assert all(r["ar_match"] is True and r["ar_tokens_per_s"] > 0 for r in b)
    overall = json.load(open(os.path.join(fast, "summary.json")))["overall"]
    assert set(overall["sources"]) == ({"lookup", "module"} if source == "lookup+module" else {"module"})
    if source == "lookup+module":
        assert overall["sources"]["lookup"]["accepted"] > 0
        assert "lookup+module" in open(os.path.join(fast, "table.md")).read()


@pytest.mark.parametrize("method,width", [("lookup", "W=1"), ("lookup", "W=4"), ("suffix", "W=4")])
def test_the_lookup_chain_is_scored_fast_and_equals_its_runtime(capsys, tiny_target_dir, tmp_path, method, width):
    """W = 4: the branching lookup's trees, replayed just as exactly; the priced context statistics too (each
    prompt's drafter fresh on both sides, priced with the machine's cached row costs)."""
    fast, exact = str(tmp_path / "fast"), str(tmp_path / "exact")
    common = [f"method={method}", "limit=2", "lookup_min_ngram=1", "draft_length=4", width, "tree_nodes=8"]
    assert run_eval(capsys, tiny_target_dir, fast, *common)[0] == 0
    assert run_eval(capsys, tiny_target_dir, exact, *common, "exact_trace=true")[0] == 0
    a, b = samples(fast), samples(exact)
    assert [r["mode"] for r in a] == ["fast"] * 6 and [r["mode"] for r in b] == ["runtime"] * 6
    figures = ("N", "cycles", "accepted", "accepted_histogram", "sources", "text")
    assert [[r[k] for k in figures] for r in a] == [[r[k] for k in figures] for r in b]
    assert sum(r["accepted"] for r in a) > 0


def test_eagle3_trees_are_scored_fast_and_equal_their_runtime(capsys, tiny_target_dir, tmp_path):
    """EAGLE-3's dynamic tree (W = 4): greedy eval replays it over the traces (`fast_tree_stats`), and each sample
    equals the step-by-step chain runtime's (which is checked against AR)."""
    common = ["method=eagle3", "limit=1", "draft_length=3", "W=4", "tree_nodes=8", "max_new_tokens=24", "calibrate=false"]
    fast_equals_runtime(capsys, tiny_target_dir, tmp_path, common)


def fast_equals_runtime(capsys, target, tmp_path, common: list[str]) -> None:
    """Greedy eval with `common` scored fast and by the step-by-step runtime (checked against AR): every sample's
    figures equal."""
    fast, exact = str(tmp_path / "fast"), str(tmp_path / "exact")
    assert run_eval(capsys, target, fast, *common)[0] == 0
    assert run_eval(capsys, target, exact, *common, "exact_trace=true")[0] == 0
    a, b = samples(fast), samples(exact)
    assert [r["mode"] for r in a] == ["fast"] * 3 and [r["mode"] for r in b] == ["runtime"] * 3
    assert all(r["ar_match"] for r in b)
    figures = ("N", "cycles", "accepted", "accepted_histogram", "drafted", "text")
    assert [[r[k] for k in figures] for r in a] == [[r[k] for k in figures] for r in b]


def test_sampled_eval_reports_pooled_and_per_sample(capsys, tiny_target_dir, tmp_path):
    out = str(tmp_path / "t1")
    code, err = run_eval(capsys, tiny_target_dir, out, "n=3", "limit=1", "temperature=1.0", "calibrate=false")
    assert code == 0, err
    rows = samples(out)
    assert len(rows) == 3 and all(r["mode"] == "runtime" and r["T"] == 1.0 and r["top_k"] == 50 for r in rows)
    assert all(r["tokens_per_s"] > 0 and r["ar_tokens_per_s"] > 0 and r["ar_match"] is None for r in rows)
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["overall"]["eal_pooled"] > 0 and summary["overall"]["eal_mean_of_ratios"] > 0
    assert "T=1, W=1" in open(os.path.join(out, "table.md")).read()
    # per-prompt seeds: the same prompt gives the same sample in a fresh run
    again = str(tmp_path / "t1b")
    assert run_eval(capsys, tiny_target_dir, again, "n=3", "limit=1", "temperature=1.0", "calibrate=false")[0] == 0
    assert [r["text"] for r in samples(again)] == [r["text"] for r in rows]


def test_report_rebuilds_table_and_plots_from_several_runs(capsys, tiny_target_dir, tmp_path):
    dirs = []
    for n in (2, 3):
        out = str(tmp_path / f"n{n}")
        assert run_eval(capsys, tiny_target_dir, out, f"n={n}", "limit=1", "calibrate=false")[0] == 0
        dirs.append(out)
    report = str(tmp_path / "report")
    assert main(["report", *dirs, "--out", report]) == 0
    capsys.readouterr()
    table = open(os.path.join(report, "table.md")).read()
    assert "SPD (n=2, L_s=1, untrained)" in table and "SPD (n=3, L_s=1, untrained)" in table
    assert os.path.exists(os.path.join(report, "eal_vs_n.png"))
    assert main(["report", str(tmp_path)]) == 2
    assert "summary.json" in capsys.readouterr().err


def test_trace_cache_keys_and_invalidation(tiny_target_dir, tmp_path):
    loaded = load_target(tiny_target_dir)
    staged = StagedTarget(loaded.model, 3)
    base = trace_key(loaded.fingerprint, staged.bounds, staged.dtype, staged.device, 12)
    assert base != trace_key("0" * 16, staged.bounds, staged.dtype, staged.device, 12)          # target
    assert base != trace_key(loaded.fingerprint, [4, 8], staged.dtype, staged.device, 12)       # layout
    assert base != trace_key(loaded.fingerprint, staged.bounds, staged.dtype, staged.device, 13)  # settings
    cache = TraceCache(str(tmp_path), loaded, staged, 12)
    first, info = cache.get("gsm8k", 1, [5, 6, 7])
    assert info["recorded_now"] and cache.has("gsm8k", 1)
    same, info = cache.get("gsm8k", 1, [5, 6, 7])
    assert not info["recorded_now"] and same.tokens == first.tokens
    _, info = cache.get("gsm8k", 1, [5, 6, 8])  # the prompt changed: recorded again
    assert info["recorded_now"]


def test_a_longer_recording_serves_a_shorter_run(tiny_target_dir, tmp_path):
    """A run of 6 tokens reads a 12-token directory: its traces equal a 6-token recording bitwise (tokens, margins,
    states); a prompt the directory lacks is recorded at the directory's length."""
    loaded = load_target(tiny_target_dir)
    staged = StagedTarget(loaded.model, 3)
    long = TraceCache(str(tmp_path / "shared"), loaded, staged, 12)
    long.get("gsm8k", 1, [5, 6, 7])
    short = TraceCache(str(tmp_path / "shared"), loaded, staged, 6)
    assert short.directory == long.directory
    cut, info = short.get("gsm8k", 1, [5, 6, 7])
    alone, _ = TraceCache(str(tmp_path / "alone"), loaded, staged, 6).get("gsm8k", 1, [5, 6, 7])
    assert not info["recorded_now"] and len(cut.tokens) == 6
    assert cut.tokens == alone.tokens and cut.margins == alone.margins
    assert cut.hidden.keys() == alone.hidden.keys()
    for layer, h in alone.hidden.items():
        assert torch.equal(cut.hidden[layer], h)
    new, info = short.get("gsm8k", 2, [9, 8, 7])
    assert len(new.tokens) == 6 and not info["recorded_now"]      # its time is a 12-token decode's
    assert len(long.get("gsm8k", 2, [9, 8, 7])[0].tokens) == 12
    assert TraceCache(str(tmp_path / "shared"), loaded, staged, 13).directory != long.directory


def test_traces_recorded_in_batches_equal_one_at_a_time(capsys, tiny_target_dir, tmp_path):
    """batch_size=4 records every trace of the run (tokens, margins, hidden states) as one-at-a-time recording does,
    and the eval's samples are the same; its traces report no one-sequence AR speed (their time was shared)."""
    common = ["n=3", "limit=3", "calibrate=false"]
    one, four = str(tmp_path / "one"), str(tmp_path / "four")
    assert run_eval(capsys, tiny_target_dir, one, *common)[0] == 0
    code, err = run_eval(capsys, tiny_target_dir, four, *common, "batch_size=4")
    assert code == 0, err
    for a, b in zip(samples(one), samples(four)):
        assert a["ar_tokens_per_s"] is not None and b["ar_tokens_per_s"] is None
        a.pop("wall_s"), b.pop("wall_s"), a.pop("ar_tokens_per_s"), b.pop("ar_tokens_per_s")
        assert a == b
    files = sorted(glob.glob(os.path.join(one + "-traces", "*", "*.pt")))
    assert len(files) == 9
    for path in files:
        solo = torch.load(path)
        batched = torch.load(path.replace(one + "-traces", four + "-traces"))
        assert batched["batch_size"] == 4 and solo["tokens"] == batched["tokens"]
        assert solo["margins"] == pytest.approx(batched["margins"], abs=1e-5)
        for layer, h in solo["hidden"].items():
            torch.testing.assert_close(batched["hidden"][layer], h, rtol=1e-5, atol=1e-5)
    code, err = run_eval(capsys, tiny_target_dir, str(tmp_path / "bad"), *common, "batch_size=0")
    assert code == 2 and "batch_size=0" in err and err.count("\n") == 1 and not os.path.exists(tmp_path / "bad")


@pytest.mark.parametrize("method", ["spd", "lookup"])
def test_step_by_step_samples_in_batches_equal_one_at_a_time(capsys, tiny_target_dir, tmp_path, method):
    """T = 1 (seeded per prompt) and greedy step-by-step samples decoded batch_size=4 at a time (SEED's schedule for
    SPD, the batched chain for the lookup) are the samples decoded one at a time; greedy ones still equal AR."""
    for extra in (["temperature=1.0"], ["exact_trace=true"]):
        common = [f"method={method}", *(["n=3"] if method == "spd" else []), "limit=2", "calibrate=false", *extra]
        one, four = str(tmp_path / f"one{extra[0]}{method}"), str(tmp_path / f"four{extra[0]}{method}")
        assert run_eval(capsys, tiny_target_dir, one, *common)[0] == 0
        code, err = run_eval(capsys, tiny_target_dir, four, *common, "batch_size=4")
        assert code == 0, err
        ones, fours = samples(one), samples(four)
        assert [r["text"] for r in fours] == [r["text"] for r in ones] and len(ones) == 6
        assert all(r["batch_size"] == 4 and r["tokens_per_s"] is None for r in fours)
        assert [r["N"] for r in fours] == [r["N"] for r in ones]
        if extra == ["exact_trace=true"]:
            assert all(r["ar_match"] for r in fours)


@pytest.fixture(scope="module")
def foreign_checkpoint(tmp_path_factory):
    loaded = load_target("tiny-qwen3")
    module = SpeculationModule.from_target(StagedTarget(loaded.model, 3), 1)
    path = str(tmp_path_factory.mktemp("foreign") / "module")
    save_checkpoint(module, loaded, path)
    return path


@pytest.mark.parametrize("args,needle", [
    (["datasets=[mt_bench,alpaca]"], "unknown dataset 'alpaca'"),
    (["checkpoint=/nonexistent/ckpt"], "/nonexistent/ckpt"),
    (["temperature=-0.5"], "temperature=-0.5"),
    (["top_p=0"], "top_p=0"),
    (["top_p=1.5"], "top_p=1.5"),
    (["limit=0"], "limit=0"),
    (["bogus_key=1"], "bogus_key"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(capsys, tiny_target_dir, tmp_path, args, needle):
    out = tmp_path / "never"
    code, err = run_eval(capsys, tiny_target_dir, str(out), "limit=1", *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_bad_output_dirs_and_foreign_checkpoint(capsys, tiny_target_dir, tmp_path, foreign_checkpoint):
    code, err = run_eval(capsys, tiny_target_dir, str(tmp_path / "x"), "limit=1", f"checkpoint={foreign_checkpoint}")
    assert code == 2 and "target" in err and len(err.strip().splitlines()) == 1
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    code, err = run_eval(capsys, tiny_target_dir, str(blocker / "sub"), "limit=1")
    assert code == 2 and "is a file" in err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("someone else's")
    code, err = run_eval(capsys, tiny_target_dir, str(foreign), "limit=1")
    assert code == 2 and "not written by `spd-infer eval`" in err
    assert os.listdir(foreign) == ["notes.txt"]


@pytest.mark.parametrize("method", ["ppsd", "spd_output_state", "eagle3", "lookup", "suffix"])
def test_every_method_evaluates_losslessly_with_its_own_figures(capsys, tiny_target_dir, tmp_path, method):
    out = str(tmp_path / method)
    shape = ["draft_length=3"] if method in ("eagle3", "lookup", "suffix") else ["n=3"]
    code, err = run_eval(capsys, tiny_target_dir, out, f"method={method}", "limit=1", "exact_trace=true", *shape)
    assert code == 0, err
    rows = samples(out)
    assert len(rows) == 3 and all(r["method"] == method and r["ar_match"] for r in rows)
    summary = json.load(open(os.path.join(out, "summary.json")))
    table = open(os.path.join(out, "table.md")).read()
    overall = summary["overall"]
    L = load_target(tiny_target_dir).model.config.num_hidden_layers
    if method == "eagle3":
        tau = sum(r["N"] - 1 for r in rows) / sum(r["cycles"] for r in rows)
        assert overall["tau_pooled"] == pytest.approx(tau)
        assert summary["speedup"]["formula"]["overall"] == pytest.approx(tau * L / (3 + L))
        assert summary["speedup"]["wall_clock"]["overall"] > 0
        cal = summary["speedup"]["calibration"]      # a cycle timed part by part: m drafts, verify, update
        assert cal["m"] == 3 and cal["cycle_s"] == pytest.approx(cal["drafts_s"] + cal["verify_s"] + cal["update_s"])
        assert summary["speedup"]["measured_cost"]["overall"] == pytest.approx(tau * cal["ar_token_s"] / cal["cycle_s"])
        assert "EAGLE-3 (m=3, untrained)" in table
    elif method in ("lookup", "suffix"):              # no model drafts: S = tau, no module to calibrate
        tau = sum(r["N"] - 1 for r in rows) / sum(r["cycles"] for r in rows)
        assert overall["tau_pooled"] == pytest.approx(tau)
        assert summary["speedup"]["formula"]["overall"] == pytest.approx(tau)
        assert summary["speedup"]["measured_cost"] is None and summary["speedup"]["wall_clock"]["overall"] > 0
        assert f"{METHODS[method].label} (m=3)" in table and summary["run"]["module_layers"] == 0
    else:
        assert overall["eal_pooled"] == pytest.approx(3 * overall["N"] / overall["K"])
        # drafting after the step: S = L'acc * L / (L_s * n + L)
        assert summary["speedup"]["formula"]["overall"] == pytest.approx(overall["eal_pooled"] * L / (3 + L))
        assert summary["speedup"]["measured_cost"]["overall"] > 0
        assert {"ppsd": "PPSD", "spd_output_state": "SPD output states"}[method] + " (n=3" in table
