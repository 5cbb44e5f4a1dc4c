"""`spd.eval.report`: the Table-1 Markdown and the plots from synthetic `spd-infer eval` summaries."""

import json
import os

import pytest

from spd.errors import UserError
from spd.eval.report import load_run, markdown_table, report_command

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DATASETS = ("mt_bench", "gsm8k", "humaneval")


def _entry(n: int, N: int, K: int, hist: dict[str, int]) -> dict:
    return {"samples": 2, "N": N, "K": K, "alpha_pooled": N / K, "eal_pooled": n * N / K,
            "eal_mean_of_ratios": n * N / K, "alpha_mean_of_ratios": N / K, "rollbacks": 3,
            "accepted_run_histogram": hist, "ar_checked": 2, "ar_match": 2,
            "tokens_per_s": None, "ar_tokens_per_s": None}


def _summary(n: int, temperature: float, Ks: tuple[int, int, int], measured: bool = False) -> dict:
    N = 100
    datasets = {name: _entry(n, N, K, {"0": 3, "1": 2, "4": 1}) for name, K in zip(DATASETS, Ks)}
    overall = _entry(n, 3 * N, sum(Ks), {"0": 9, "1": 6, "4": 3})
    formula = {name: d["eal_pooled"] for name, d in datasets.items()} | {"overall": overall["eal_pooled"]}
    return {
        "run": {"method": "spd", "label": f"SPD (n={n}, L_s=1)", "n": n, "module_layers": 1,
                "temperature": temperature, "top_k": 0, "top_p": 1.0, "W": 1, "max_new_tokens": 64,
                "checkpoint": None, "target": "SmolLM2-135M-Instruct", "mode": "fast"},
        "datasets": datasets,
        "overall": overall,
        "speedup": {"formula": formula,
                    "measured_cost": {k: v / 2 for k, v in formula.items()} if measured else None,
                    "calibration": None},
        "meta": {"config": {}, "git_commit": "abc123", "machine": "test", "dtype": "float32", "seed": 0,
                 "created": "2025-01-01T00:00:00"},
    }


def _write(tmp_path, name: str, summary: dict) -> str:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "summary.json").write_text(json.dumps(summary))
    return str(directory)


def _is_png(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == PNG_SIGNATURE


def _no_tmp_files(directory) -> bool:
    return not [name for name in os.listdir(directory) if name.endswith(".tmp")]


def test_report_three_runs(tmp_path):
    runs = {"n3": _summary(3, 0.0, (150, 200, 250)),
            "n5": _summary(5, 0.0, (200, 250, 400), measured=True),
            "n5_t1": _summary(5, 1.0, (250, 500, 1000))}
    dirs = [_write(tmp_path, name, summary) for name, summary in runs.items()]
    out = tmp_path / "report"
    written = report_command(dirs, str(out))

    names = ["table.md", "eal_per_dataset.png", "accepted_runs.png", "eal_vs_n.png", "speedup_vs_n.png"]
    assert written == [str(out / name) for name in names]
    for path in written[1:]:
        assert _is_png(path)
    assert _no_tmp_files(out)

    table = (out / "table.md").read_text()
    for header in ("SPD (n=3, L_s=1)", "SPD (n=5, L_s=1)", "T=0, W=1", "T=1, W=1",
                   "MT-Bench", "GSM8K", "HumanEval", "Mean"):
        assert header in table
    # mean over datasets of the pooled L'acc: n=3 -> (2 + 1.5 + 1.2)/3, n=5 T=0 -> (2.5 + 2 + 1.25)/3
    assert f"| SPD (n=3, L_s=1) | {(2 + 1.5 + 1.2) / 3:.2f} | – |" in table
    assert f"| SPD (n=5, L_s=1) | {(2.5 + 2 + 1.25) / 3:.2f} | {(2 + 1 + 0.5) / 3:.2f} |" in table
    assert "| SPD (n=3, L_s=1) | 2.00 | – |" in table       # MT-Bench table
    assert "| SPD (n=5, L_s=1) | 1.25 | 0.50 |" in table    # HumanEval table
    # speedup rows: formula / measured, measured '–' when null
    assert "| SPD (n=5, L_s=1) | T=0, W=1 | 2.50 / 1.25 | 2.00 / 1.00 | 1.25 / 0.62 | 1.92 / 0.96 |" in table
    assert "| SPD (n=3, L_s=1) | T=0, W=1 | 2.00 / – |" in table
    assert "n·ΣN/ΣK" in table and "summary.json" in table


def test_single_n_has_no_eal_vs_n(tmp_path):
    dirs = [_write(tmp_path, "a", _summary(5, 0.0, (200, 250, 400))),
            _write(tmp_path, "b", _summary(5, 1.0, (250, 500, 1000)))]
    written = report_command(dirs, None)
    assert [os.path.basename(p) for p in written] == ["table.md", "eal_per_dataset.png", "accepted_runs.png"]
    assert all(os.path.dirname(p) == dirs[0] for p in written)
    assert not os.path.exists(os.path.join(dirs[0], "eal_vs_n.png"))
    assert _no_tmp_files(dirs[0])


def test_later_run_wins_and_missing_datasets():
    first, later = _summary(3, 0.0, (150, 200, 250)), _summary(3, 0.0, (300, 300, 300))
    del later["datasets"]["humaneval"]
    table = markdown_table([first, later])
    assert table.count("| SPD (n=3, L_s=1) | 1.00 |") == 3   # mean, MT-Bench, GSM8K all from the later run
    assert "## HumanEval" not in table


def test_load_run_errors(tmp_path):
    with pytest.raises(UserError, match="holds no summary.json"):
        load_run(str(tmp_path))
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(UserError, match="unreadable"):
        load_run(str(tmp_path))
    with pytest.raises(UserError):
        report_command([], None)


def _eagle(m: int, tau: float) -> dict:
    summary = _summary(1, 0.0, (100, 100, 100))
    summary["run"].update(method="eagle3", label=f"EAGLE-3 (m={m})", draft_length=m)
    for entry in [*summary["datasets"].values(), summary["overall"]]:
        entry.pop("eal_pooled")
        entry["tau_pooled"] = tau
    s = tau * 30 / (m + 30)
    summary["speedup"]["formula"] = {k: s for k in [*DATASETS, "overall"]}
    return summary


def test_speedup_against_m_for_eagle3_and_against_n_for_the_pipelined_methods(tmp_path):
    from spd.eval.report import plot_eal_vs_n, plot_speedup_vs_m, plot_speedup_vs_n

    spd = [_summary(3, 0.0, (150, 200, 250)), _summary(5, 0.0, (200, 250, 400))]
    ppsd = [dict(s, run={**s["run"], "method": "ppsd", "label": s["run"]["label"].replace("SPD", "PPSD")})
            for s in spd]
    eagle = [_eagle(3, 1.4), _eagle(5, 1.5), _eagle(7, 1.52)]
    runs = spd + ppsd + eagle
    dirs = [_write(tmp_path, f"r{i}", s) for i, s in enumerate(runs)]
    written = [os.path.basename(p) for p in report_command(dirs, str(tmp_path / "out"))]
    assert written[-3:] == ["eal_vs_n.png", "speedup_vs_n.png", "speedup_vs_m.png"]
    # EAGLE-3 alone: a curve against m, none against n (its n = 1 is no pipeline); one m: no curve
    assert plot_speedup_vs_m(eagle, str(tmp_path / "m.png")) and _is_png(str(tmp_path / "m.png"))
    assert not plot_speedup_vs_n(eagle, str(tmp_path / "n.png")) and not plot_eal_vs_n(eagle, str(tmp_path / "e.png"))
    assert not plot_speedup_vs_m(eagle[:1] + spd, str(tmp_path / "m1.png"))


def test_eagle3_rows_show_the_wall_clock_beside_formula_and_measured_cost():
    greedy, sampled = _eagle(3, 1.4), _eagle(3, 1.3)
    sampled["run"]["temperature"] = 1.0
    sampled["speedup"]["measured_cost"] = {k: 0.5 for k in [*DATASETS, "overall"]}
    sampled["speedup"]["wall_clock"] = {k: 0.4 for k in [*DATASETS, "overall"]}
    table = markdown_table([greedy, _summary(3, 0.0, (150, 200, 250)), sampled])
    s = 1.4 * 30 / 33
    assert f"| EAGLE-3 (m=3) | T=0, W=1 | {s:.2f} / – | {s:.2f} / – | {s:.2f} / – | {s:.2f} / – |" in table
    s = 1.3 * 30 / 33
    assert f"| EAGLE-3 (m=3) | T=1, W=1 | {s:.2f} / 0.50 / 0.40 | {s:.2f} / 0.50 / 0.40 |" in table
    assert "| SPD (n=3, L_s=1) | T=0, W=1 | 2.00 / – |" in table   # pipelined rows: no clock column
