"""Results are data that a document cites: every file under docs/results/ is named by some docs/*.md page (itself, or
a folder that holds it), so a section dropped from the pages shows up as a failing test instead of a silent loss; and
each page stays short enough to read (at most 600 lines)."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")
MAX_PAGE_LINES = 600


def pages() -> list[str]:
    """Every docs/*.md page."""
    return sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def pages_text() -> str:
    texts = []
    for path in pages():
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    return "\n".join(texts)


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


def test_every_results_file_is_cited_by_a_docs_page():
    assert pages(), "no docs/*.md page"
    text = pages_text()
    files = results_files()
    assert files, "docs/results/ is empty"
    missing = [path for path in files if not cited(path, text)]
    assert not missing, f"{len(missing)} results file(s) no docs/*.md page cites: {missing}"


def test_no_docs_page_is_longer_than_the_limit():
    long = {}
    for path in pages():
        with open(path, encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        if lines > MAX_PAGE_LINES:
            long[os.path.relpath(path, ROOT)] = lines
    assert not long, f"docs pages over {MAX_PAGE_LINES} lines: {long}"


def test_a_folder_cites_what_it_holds_and_a_lookalike_does_not():
    text = "see docs/results/eval/grid_214k/ and ![x](results/speed.json)"
    assert cited("eval/grid_214k/greedy_spd_n3/summary.json", text)
    assert cited("speed.json", text)
    assert not cited("eval/grid_214k_other/summary.json", text)
    assert cited("speed.jsonl", text) and not cited("speedy.json", text)
