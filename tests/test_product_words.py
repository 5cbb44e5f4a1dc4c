"""The project speaks of itself as a product: its README, docs, code, benches, configs and tests say what the
software does and what was measured, never how the work on it was organised (work tickets by number, rounds of
measuring, the machines or time slots a piece of work ran in). Each pattern below names one such phrase; the
everyday senses of the same words (look up, a stop string, the `Session` class, a W&B or HTTP session, what a
decoder visits) do not match. Paths and file names (bench/gpu_session.py, docs/results/...) are not prose and are
left out of the scan."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRS = ("spd", "bench", "experiments", "tests", "infer", "train", "configs")
SUFFIXES = (".py", ".md", ".sh", ".yaml", ".yml", ".toml")
SKIP_DIRS = {".venv", "__pycache__", ".git", "node_modules"}
THIS = os.path.relpath(os.path.abspath(__file__), ROOT)

# between two words: spaces, a line break, a comment's or a quote's marker, emphasis, the quotes of two string literals
_ = r"[\s#>*\"]+"
ORDINAL = (r"(?:second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth"
           r"|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|thirtieth|fortieth"
           r"|(?:twenty|thirty|forty)-(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)"
           r"|\d+(?:st|nd|rd|th))")
LATER = r"(?:this|next|previous|earlier|later|last|latest|every|each)"  # not "that": "values that look odd"
LATER_PLURAL = r"(?:earlier|later|previous|last|latest)"  # not "this/that/each": "that looks right", "each stops"
# what follows "look" when it is the verb (look at, look up, ...), not a round of work
LOOK_VERB = r"(?!" + _ + r"(?:at|up|like|into|for|over|through|ahead|inside|back|around|out|away|as|to)\b)"
# what follows "stop" when it is the decoder's stop (a stop string, the stop rule, ...)
STOP_THING = (r"(?!" + _ + r"(?:strings?|tokens?|sequences?|reasons?|rules?|conditions?|criteri\w*|signals?|words?"
              r"|lists?|sets?|checks?|events?|flags?|texts?|ids?|buttons?)\b)")
# a session's own attributes: "this session's stages" is the open `Session`, not a stretch of work
SESSION_ATTR = (r"(?!'s" + _ + r"(?:stages|drafters?|method|module|params|draft" + _ + r"model|row" + _ + r"costs"
                r"|loaded|staged|tokenizer|width)\b)")
SESSION = r"sessions?\b(?!\.\w|\(|_)" + SESSION_ATTR  # not session.method, session(...), session_x

PATTERNS = {
    "issue number": r"\b(?i:issues?)" + _ + r"#?\d+",
    "the issue": (r"\b(?i:the|this|that)" + _ + r"issue's|\b(?i:this)" + _ + r"issue\b|\b(?i:issue)\s+\""
                  r"|\b(?i:per)" + _ + r"the" + _ + r"issue\b"
                  r"|\bthe" + _ + r"issue" + _ + r"(?:asks|can" + _ + r"close)\b"
                  r"|\b(?i:next|previous|earlier|later|last)" + _ + r"(?:(?:speed|GPU|training)" + _ + r")?issues?\b"),
    "round of work (look)": (r"\b(?i:" + ORDINAL + r"|" + LATER + r"|the" + _ + r"first)" + _
                             + r"(?i:look)\b(?!')" + LOOK_VERB
                             + r"|\b(?i:" + ORDINAL + r"|" + LATER_PLURAL + r"|the)" + _ + r"(?i:looks)\b" + LOOK_VERB
                             + r"|\b(?i:" + ORDINAL + r"|first|that|" + LATER + r")" + _ + r"(?i:look's)"
                             + r"|(?<![\w'])(?i:first)" + _ + r"(?i:look)" + _ + r"\("),
    "visit": (r"\b(?i:a|an|the|this|that|one|each|every|later|earlier|next|previous|last|latest|only|same|first"
              r"|whole|prepared|gpu|device|h\d+|two|three|four|five|six|\d+|" + ORDINAL + r")" + _
              + r"visits?\b|\b(?i:visit's)"),
    "lottery": r"\b(?i:lottery)\b",
    "lent": r"\b(?i:lent)\b",
    "session": (r"\b(?i:this|that|later|earlier|previous|next|latest|last|first|one|whole|another|same|each|every"
                r"|gpu|cpu|device|h\d+|\d+-core|" + ORDINAL + r")" + _ + SESSION
                + r"|\b(?i:between|across)" + _ + r"sessions\b"
                # "the session" alone is as often the open `Session` ("the session's draft model"): only what a
                # stretch of work does
                + r"|\b(?i:the)" + _ + r"session" + _ + r"(?:before|took|ran|spent|series|had" + _ + r"no" + _
                + r"(?:quiet" + _ + r")?time)\b"
                + r"|\b(?i:the)" + _ + r"session's" + _ + r"(?:machine|earlier|eval|budget|timings|\d"
                + r"|(?:first|second)" + _ + r"(?:run|look|visit|call))"
                + r"|\b(?i:start|end|calls?|rows?|payload|rest)" + _ + r"of" + _ + r"the" + _ + r"session\b"
                + r"|\b(?i:fit)" + _ + r"the" + _ + r"session\b"),
    "stop (of work)": (r"\b(?i:this|that|each|every|later|earlier|next|previous|last|latest)" + _ + r"stop\b"
                       + STOP_THING + r"|\b(?i:" + LATER_PLURAL + r")" + _ + r"stops\b" + STOP_THING
                       + r"|\b(?i:the)" + _ + r"stops?" + _ + r"(?:before|after)\b|\b(?i:the)" + _ + r"stop's"
                       + r"|\b(?i:stops?)" + _ + r"#?\d+\b(?!\s*(?:tokens?|times?|steps?|s\b|ms\b))"),
}
COMPILED = {name: re.compile(p) for name, p in PATTERNS.items()}
# a path or a file name is not prose: bench/gpu_session.py, docs/results/gpu/<stamp>/session.json, gpu_n5.yaml
PATH = re.compile(r"[\w.<>-]*/[\w./<>*-]+|\b[\w-]+\.(?:py|sh|json|jsonl|md|yaml|yml|toml|txt|csv|log)\b")


def scanned_files() -> list[str]:
    found = [name for name in ("README.md", "CHANGELOG.md") if os.path.isfile(os.path.join(ROOT, name))]
    for top in ("docs", *DIRS):
        for directory, dirs, names in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
            rel = os.path.relpath(directory, ROOT)
            if rel == os.path.join("docs", "results") or rel.startswith(os.path.join("docs", "results") + os.sep):
                continue  # data the docs cite, written by the benches
            for name in sorted(names):
                path = os.path.normpath(os.path.join(rel, name))
                if top == "docs" and not name.endswith(".md"):
                    continue
                if name.endswith(SUFFIXES) and path != THIS:
                    found.append(path)
    return found


def masked(text: str) -> str:
    """The text with every path and file name blanked out (same length, so offsets and lines stay)."""
    return PATH.sub(lambda m: re.sub(r"\S", " ", m.group()), text)


def hits(text: str) -> list[tuple[int, str, str]]:
    """(line, pattern name, matched text) for every process phrase in text."""
    text = masked(text)
    out = []
    for name, pattern in COMPILED.items():
        for m in pattern.finditer(text):
            out.append((text.count("\n", 0, m.start()) + 1, name, " ".join(m.group().split())))
    return sorted(out)


def test_the_project_speaks_of_itself_as_a_product():
    files = scanned_files()
    assert "README.md" in files and any(f.startswith("spd" + os.sep) for f in files)
    found = []
    for path in files:
        with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
            text = f.read()
        found += [f"{path}:{line}: {matched!r} ({name})" for line, name, matched in hits(text)]
    assert not found, (f"{len(found)} phrases describe how the work was organised, not the product; say the "
                       "technical thing instead (what was measured, on what machine, where it is written up):\n"
                       + "\n".join(found))


PROCESS = [
    "(docs/results.md, issue 36's eighth look)",
    "as before issue 35",
    "(issue 22)",
    "Issue 37's first session",
    "the issue's bars",
    "the twelfth look",
    "### Twenty-first look (2026-12-02)",
    "Every look so far ended on",
    "bars after this look:",
    "the earlier looks tried",
    "the fourteenth look's session",
    "First look (2 prompts)",
    "measured on the GPU visit",
    "on the H200 visit",
    "the fifth prepared visit",
    "the visits before 2026-11-27",
    "a later visit;",
    "the second visit's fix",
    "a GPU visit's payload",
    "the device lottery",
    "an H100 lent to one session",
    "a later session",
    "this session's 2-core machine",
    "This session decoded",
    "earlier sessions' model",
    "drift between sessions",
    "the session's machine",
    "the session before",
    "fit the session",
    "the session took 216 s",
    "The session's first look",
    "11.6 of the session's 15 device minutes",
    "at the start of the session",
    "the session had no quiet time left",
    "a GPU session",
    "one 2-core session.",
    "the stop before",
    'a later "\n    "visit runs what earlier ones left',
    "the 2026-11-27 visits",
    "the whole visit (default 9)",
    "three visits;",
    "the options of issue \"sample efficiency\"",
    "30 prompts per the issue would have taken",
    "noted for the next speed issue",
    "this stop made it the default",
    "On the latest stop's machine",
    "stop 61",
    "earlier stops",
    "this stop's tests",
    "that look's session",
    "the last looks (1.20x)",
    "what a later\n    # session measured",
]
EVERYDAY = [
    "look up the key",
    "a drafter may look at it",
    "the first module layer's heads look at a = 1",
    "for the benches that look inside it",
    "a first look at acceptance",
    "stop strings",
    "whose text hit a stop string",
    "hitting a stop\n    string",
    "the stop rule, and the result record",
    "stop=[\"\\n\"]",
    "a stop token",
    "session.method",
    "engine.session.loaded.tokenizer",
    "open_session(cfg)",
    "class Session:",
    "(keyword arguments, see Session)",
    "this session's stages",
    "the session's draft model",
    "the session's method and the config",
    "the session drafts with the shipped module",
    "the module in the session",
    "Config checks, the session, the CLI",
    "a W&B session",
    "an HTTP session",
    "start_new_session=True",
    "in a new session (as a process group)",
    "@pytest.fixture(scope=\"session\")",
    "built once into this test session's cache",
    "bench/gpu_session.py --device cpu",
    "docs/results/gpu/<stamp>/session.json",
    "python -m bench.gpu_session",
    "the distribution a decoder actually visits",
    "what greedy decoding visits at n = 2",
    "a visitor",
    "visit = Visit(args)",
    "see the issues for what comes next",
    "the issue is that",
    "whose ids issue the same first command",
    "Lenth",
    "one that stops after the prefill's token",
    "this stops the decoder",
    "values that look odd",
    "that looks right",
    "this looks like a bug",
]


@pytest.mark.parametrize("phrase", PROCESS)
def test_each_process_phrase_is_caught(phrase):
    assert hits(phrase), phrase


@pytest.mark.parametrize("phrase", EVERYDAY)
def test_everyday_phrases_pass(phrase):
    assert not hits(phrase), hits(phrase)
