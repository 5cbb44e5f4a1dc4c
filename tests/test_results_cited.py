"""Results are data that a document cites: every file under docs/results/ is named by docs/results.md (itself, or a
folder that holds it), so a section dropped from the document shows up as a failing test instead of a silent loss
(issue 22: commit 2dfd494 dropped five sections whose JSON stayed behind)."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")


def cited(relpath: str, text: str) -> bool:
    """relpath (under docs/results/) or one of its folders appears as docs/results/... or as a relative link; the
    benches write per-prompt rows (X.jsonl) beside their summary (X.json), so citing X.json cites both."""
    if relpath.endswith(".jsonl") and cited(relpath[:-1], text):
        return True
    parts = relpath.split("/")
    for i in range(len(parts), 0, -1):
        name = "/".join(parts[:i])
        if re.search(r"(docs/|\()results/" + re.escape(name) + r"(?![\w.-])", text):
            return True
    return False


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
