"""Reports over `spd-infer eval` runs: a Markdown table in the layout of the SPD paper's Table 1, and plots.

Every run is one output directory of `spd-infer eval` holding a `summary.json`. The table gives L′acc
(pooled n·ΣN/ΣK per dataset) per method and decoding setting, the mean over datasets as the paper reports
it, and the speedups; the plots compare L′acc per dataset, the accepted-run lengths, and L′acc against n.
Every file is written to a temporary name in its directory and then renamed, so none is ever half-written.
"""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from spd.errors import UserError  # noqa: E402
from spd.eval.summary import METHOD_NAMES  # noqa: E402
from spd.methods import METHODS  # noqa: E402
from spd.paths import check_writable_dir  # noqa: E402

DATASETS = {"mt_bench": "MT-Bench", "gsm8k": "GSM8K", "humaneval": "HumanEval"}
DASH = "–"
DPI = 120


# ---------------------------------------------------------------- loading

def load_run(directory: str) -> dict:
    """Read `<directory>/summary.json`; UserError when it is missing, unreadable or not an eval summary."""
    path = os.path.join(directory, "summary.json")
    hint = "give a directory written by `spd-infer eval`"
    if not os.path.isfile(path):
        raise UserError(f"{directory} holds no summary.json; {hint}")
    try:
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} is unreadable ({str(exc).splitlines()[0]}); {hint}") from exc
    if not isinstance(summary, dict) or not {"run", "datasets"} <= summary.keys():
        raise UserError(f"{path} is not an eval summary (no 'run'/'datasets'); {hint}")
    return summary


# ---------------------------------------------------------------- run helpers

def setting(run: dict) -> str:
    """The decoding setting of a run, as the paper's column header: 'T=0, W=1'."""
    r = run["run"]
    return f"T={float(r['temperature']):g}, W={r['W']}"


def _setting_key(run: dict) -> tuple[float, int]:
    return float(run["run"]["temperature"]), int(run["run"]["W"])


def _series_name(run: dict) -> str:
    return f"{run['run']['label']} ({setting(run)})"


def _unique(runs: list[dict]) -> list[dict]:
    """One run per (label, setting), the later one winning (a rerun); first-appearance order is kept. Two runs
    that share a label and setting but evaluate different targets are not reruns: refused."""
    by_key: dict[tuple[str, str], dict] = {}
    for run in runs:
        key = (run["run"]["label"], setting(run))
        if key in by_key and by_key[key]["run"].get("target") != run["run"].get("target"):
            raise UserError(f"two runs labelled {key[0]!r} ({key[1]}) evaluate different targets "
                            f"({by_key[key]['run'].get('target')!r} and {run['run'].get('target')!r}); report them "
                            "separately")
        by_key[key] = run
    return list(by_key.values())


def _datasets(runs: list[dict]) -> list[str]:
    """Datasets present in any run: the paper's three in their order, then any others."""
    present = {name for run in runs for name in run["datasets"]}
    extra = sorted(present - DATASETS.keys())
    return [name for name in DATASETS if name in present] + extra


def _eal(run: dict, dataset: str) -> float | None:
    """L′acc pooled over the dataset (SPD, PPSD); for EAGLE-3's chain its τ, the figure its table reports."""
    figures = run["datasets"].get(dataset) or {}
    return figures.get("eal_pooled", figures.get("tau_pooled"))


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def mean_eal(run: dict) -> float | None:
    """L′acc averaged over the run's datasets (mean of per-dataset pooled values, as in the paper)."""
    return _mean([_eal(run, name) for name in run["datasets"]])


def _speedup(run: dict, kind: str, dataset: str) -> float | None:
    table = (run.get("speedup") or {}).get(kind) or {}
    return table.get(dataset)


# ---------------------------------------------------------------- Markdown

def _fmt(value: float | None) -> str:
    return DASH if value is None else f"{value:.2f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _method_table(runs: list[dict], cell) -> list[str]:
    """Rows = labels, columns = settings, cell(run) for each present (label, setting), '–' otherwise."""
    labels = list(dict.fromkeys(run["run"]["label"] for run in runs))
    settings = [setting(run) for run in sorted(runs, key=_setting_key)]
    settings = list(dict.fromkeys(settings))
    index = {(run["run"]["label"], setting(run)): run for run in runs}
    rows = [[label] + [cell(index[(label, s)]) if (label, s) in index else DASH for s in settings]
            for label in labels]
    return _table(["Method"] + settings, rows)


def _speedup_cell(run: dict, dataset: str | None, names: list[str]) -> str:
    def value(kind: str) -> float | None:
        if dataset is None:  # the Mean column: mean over datasets, like the L′acc tables
            return _mean([_speedup(run, kind, name) for name in names])
        return _speedup(run, kind, dataset)

    cell = f"{_fmt(value('formula'))} / {_fmt(value('measured_cost'))}"
    # runs with no pipeline (EAGLE-3's chain) are also judged by the clock, against AR in the same run
    return cell + f" / {_fmt(value('wall_clock'))}" if (run.get("speedup") or {}).get("wall_clock") else cell


def markdown_table(runs: list[dict]) -> str:
    """Table 1 of the SPD paper for these runs: L′acc (mean, then per dataset) and speedups, as Markdown."""
    runs = _unique(runs)
    names = _datasets(runs)
    lines = ["## L′acc, mean over datasets", ""] + _method_table(runs, lambda r: _fmt(mean_eal(r)))
    for name in names:
        lines += ["", f"## {DATASETS.get(name, name)}", ""]
        lines += _method_table(runs, lambda r, name=name: _fmt(_eal(r, name)))
    header = ["Method", "Setting"] + [DATASETS.get(name, name) for name in names] + ["Mean"]
    rows = [[run["run"]["label"], setting(run)] + [_speedup_cell(run, name, names) for name in names]
            + [_speedup_cell(run, None, [n for n in names if n in run["datasets"]])] for run in runs]
    lines += ["", "## Speedup (formula / measured cost; EAGLE-3 at T=1 or exact_trace=true: / wall clock)", ""]
    lines += _table(header, rows)
    lines += ["", "L′acc = n·ΣN/ΣK pooled over each dataset's samples (Mean = mean over datasets); EAGLE-3 rows "
              "show τ = tokens per target forward, bonus token included, their formula S = τ·L/(m + L), the measured-cost "
              "S = τ·T_ar/T_cycle and the wall clock = tokens/s against plain AR in the same run; the mean of "
              f"per-sample ratios is in summary.json (eal_mean_of_ratios); {DASH} = not run or not measured."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- plots

def _save(fig, path: str) -> None:
    """Save a figure as PNG through a temporary file in the same directory, then close it."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fig.savefig(tmp, format="png", dpi=DPI, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)


def _grouped_bars(ax, positions: list[int], series: dict[str, list[float]]) -> None:
    """One bar series per entry of `series`, side by side around each x position."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in positions], values, width, label=name)
    if series:
        ax.legend(fontsize="small")


def plot_eal_per_dataset(runs: list[dict], path: str) -> None:
    """Grouped bars of L′acc: x = datasets, one bar per run (label + setting); missing datasets are 0."""
    runs = _unique(runs)
    names = _datasets(runs)
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(names) * max(1, len(runs)) ** 0.5), 4))
    series = {_series_name(run): [_eal(run, name) or 0.0 for name in names] for run in runs}
    _grouped_bars(ax, list(range(len(names))), series)
    ax.set_xticks(range(len(names)), [DATASETS.get(name, name) for name in names])
    ax.set(title="Equivalent acceptance length per dataset", xlabel="dataset", ylabel="L′acc = n·ΣN/ΣK")
    _save(fig, path)


RUN_CAP = 16  # longer runs (e.g. a repetitive reply drafted right for hundreds of tokens) share the last bar


def plot_run_histogram(runs: list[dict], path: str) -> None:
    """Fraction of accepted runs of each length (overall.accepted_run_histogram), one bar series per run;
    runs of RUN_CAP or more drafts are pooled into the last bar so that rare long runs keep the axis readable."""
    runs = _unique(runs)
    hists = {}
    for run in runs:
        raw = (run.get("overall") or {}).get("accepted_run_histogram") or {}
        total = sum(raw.values())
        if total:
            hist: dict[int, float] = {}
            for k, v in raw.items():
                hist[min(int(k), RUN_CAP)] = hist.get(min(int(k), RUN_CAP), 0.0) + v / total
            hists[_series_name(run)] = hist
    lengths = list(range(max((k for h in hists.values() for k in h), default=0) + 1))
    fig, ax = plt.subplots(figsize=(min(16, max(6, 0.3 * len(lengths) * max(1, len(hists)) ** 0.5)), 4))
    _grouped_bars(ax, lengths, {name: [h.get(k, 0.0) for k in lengths] for name, h in hists.items()})
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(title="Accepted drafts between rollbacks", xlabel=f"accepted run length (last bar: {RUN_CAP} or more)",
           ylabel="fraction of runs")
    _save(fig, path)


def _method(run: dict) -> str:
    return run["run"].get("method") or "spd"


def _pipelined(run: dict) -> bool:
    """Plotted against n; the draft-then-verify chains (EAGLE-3, the lookup) against their draft length m."""
    return METHODS[_method(run)].pipelined if _method(run) in METHODS else True


def _plot_lines(runs: list[dict], x_of, y_of, line_of, path: str, title: str, xlabel: str, ylabel: str) -> bool:
    """One line per line_of(run) through (x_of(run), y_of(run)); written (True) only with >= 2 distinct x.
    y_of may be a dict {name: y_of}: one line per (run line, name), solid for the first, dashed for the others."""
    curves = y_of if isinstance(y_of, dict) else {"": y_of}
    points = [(line_of(run), name, x_of(run), y(run))
              for run in sorted(_unique(runs), key=_setting_key) for name, y in curves.items()]
    points = [p for p in points if p[3] is not None]
    if len({x for _, _, x, _ in points}) < 2:
        return False
    lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for line, name, x, y in points:
        lines.setdefault((line, name), []).append((x, y))
    fig, ax = plt.subplots(figsize=(6, 4))
    first = next(iter(curves))
    colours: dict[str, str] = {}   # one colour per run line, shared by its curves
    for (line, name), xy in lines.items():
        xs, ys = zip(*sorted(xy))
        colour = colours.setdefault(line, f"C{len(colours) % 10}")
        ax.plot(xs, ys, "o-" if name == first else "s--", color=colour, label=f"{line}, {name}" if name else line)
    ax.set_xticks(sorted({x for _, _, x, _ in points}))
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if len(curves) > 1:
        ax.axhline(1.0, color="grey", linewidth=0.8)   # plain decoding
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0))
    else:
        ax.legend(fontsize="small")
    _save(fig, path)
    return True


def plot_eal_vs_n(runs: list[dict], path: str) -> bool:
    """L′acc (mean over datasets) against n, one line per (method, module layers, setting); pipelined runs only."""
    return _plot_lines([r for r in runs if _pipelined(r)], lambda r: r["run"]["n"], mean_eal,
                       lambda r: f"{METHOD_NAMES.get(_method(r), _method(r))}, L_s={r['run']['module_layers']}, "
                                 f"{setting(r)}",
                       path, "L′acc against pipeline stages n", "n (pipeline stages)", "L′acc, mean over datasets")


def _overall_speedup(run: dict) -> float | None:
    return _speedup(run, "formula", "overall")


# the layer-count formula and, where the run was timed, the speedup from the measured costs
SPEEDUPS = {"formula": _overall_speedup, "measured cost": lambda run: _speedup(run, "measured_cost", "overall")}


def plot_speedup_vs_n(runs: list[dict], path: str) -> bool:
    """The formula speedup and the measured-cost one (pooled over datasets) against n, one line each per (method,
    setting); pipelined runs."""
    return _plot_lines([r for r in runs if _pipelined(r)], lambda r: r["run"]["n"], SPEEDUPS,
                       lambda r: f"{METHOD_NAMES.get(_method(r), _method(r))}, {setting(r)}",
                       path, "Speedup against pipeline stages n", "n (pipeline stages)", "speedup (overall)")


def plot_speedup_vs_m(runs: list[dict], path: str) -> bool:
    """EAGLE-3's S = τ·L/(L_s·m + L) and its measured-cost S (pooled over datasets) against its draft length m, one
    line each per setting."""
    return _plot_lines([r for r in runs if not _pipelined(r)], lambda r: r["run"]["draft_length"],
                       SPEEDUPS, lambda r: f"EAGLE-3, {setting(r)}",
                       path, "EAGLE-3: speedup against draft length m", "m (drafts per target forward)",
                       "S, overall")


# ---------------------------------------------------------------- report

def _write_text(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_report(runs: list[dict], out_dir: str) -> list[str]:
    """Write table.md, eal_per_dataset.png, accepted_runs.png, and the curves that have >= 2 points on their axis:
    eal_vs_n.png and speedup_vs_n.png (pipelined methods), speedup_vs_m.png (EAGLE-3)."""
    os.makedirs(out_dir, exist_ok=True)
    path = lambda name: os.path.join(out_dir, name)  # noqa: E731
    _write_text(path("table.md"), markdown_table(runs))
    plot_eal_per_dataset(runs, path("eal_per_dataset.png"))
    plot_run_histogram(runs, path("accepted_runs.png"))
    written = [path("table.md"), path("eal_per_dataset.png"), path("accepted_runs.png")]
    for name, plot in (("eal_vs_n.png", plot_eal_vs_n), ("speedup_vs_n.png", plot_speedup_vs_n),
                       ("speedup_vs_m.png", plot_speedup_vs_m)):
        if plot(runs, path(name)):
            written.append(path(name))
    return written


def report_command(dirs: list[str], out_dir: str | None = None) -> list[str]:
    """Load every `spd-infer eval` directory and write the report (into the first directory by default)."""
    if not dirs:
        raise UserError("report needs at least one directory written by `spd-infer eval`")
    runs = [load_run(directory) for directory in dirs]
    _unique(runs)  # refuses conflicting runs before anything is written
    check_writable_dir(out_dir or dirs[0], "--out")
    return write_report(runs, out_dir or dirs[0])
