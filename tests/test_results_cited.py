"""Results are data that a document cites: every file under docs/results/ is named by docs/results.md (itself, or a
folder that holds it), so a section dropped from the document shows up as a failing test instead of a silent loss
(issue 22: commit 2dfd494 dropped five sections whose JSON stayed behind)."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")


def mentions(text: str) -> set[str]:
    """Every path under docs/results/ the text names (as docs/results/... or a relative link), folders without '/'."""
    return {m.rstrip("/.") for m in re.findall(r"(?:docs/|\()results/([\w./-]+)", text)}


def cited(relpath: str, text: str) -> bool:
    """relpath (under docs/results/) or a folder holding it is named whole; the benches write per-prompt rows
    (X.jsonl) beside their summary (X.json), so naming X.json cites both."""
    named = mentions(text)
    parts = relpath.split("/")
    if any("/".join(parts[:i]) in named for i in range(1, len(parts) + 1)):
        return True
    return relpath.endswith(".jsonl") and relpath[:-1] in named


def results_files() -> list[str]:
    found = []
    for directory, dirs, names in os.walk(RESULTS):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found += [os.path.relpath(os.path.join(directory, name), RESULTS) for name in names if not name.endswith(".tmp")]
    return sorted(found)


def test_every_results_file_is_cited_by_docs_results_md():
    with open(os.path.join(ROOT, "docs", "results.md"), encoding="utf-8") as f:
        text = f.read()
    files = results_files()
    assert files, "docs/results/ is empty"
    missing = [path for path in files if not cited(path, text)]
    assert not missing, f"{len(missing)} results file(s) no section of docs/results.md cites: {missing}"


def test_a_folder_cites_what_it_holds_and_a_lookalike_does_not():
    text = "see docs/results/eval/grid_214k/ and ![x](results/speed.json)"
    assert cited("eval/grid_214k/greedy_spd_n3/summary.json", text)
    assert cited("speed.json", text)
    assert not cited("eval/grid_214k_other/summary.json", text)
    assert cited("speed.jsonl", text) and not cited("speedy.json", text)
