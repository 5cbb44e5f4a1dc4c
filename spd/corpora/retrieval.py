"""The datastores a run can draft from (`datastore=`, spd.corpora.datastore):

- `sharegpt` — the assistant turns of the ShareGPT conversations, tokenised for the run's target and kept under
  $SPD_CACHE_DIR/datastore/<tokenizer key>.safetensors the first time (about half a minute on 2 cores for the default
  target; every later start reads the file);
- `answers` — the target's own greedy answers to other ShareGPT first turns (bench/target_answers.py writes them;
  the package ships the default target's), sorted when a run opens them;
- the path of a datastore file that `Datastore.save` wrote, or of a documents file that `save_documents` wrote (an
  answers file of another size), for the same tokenizer;
- your own text: a `.txt` file (one document) or a `.jsonl` file (one `{"text": ...}` object a line, one document
  each), tokenised for the run's target and kept under $SPD_CACHE_DIR/datastore/ keyed by the file's bytes and the
  tokenizer the first time (a changed file is built again);
- several of these joined by `+` (`answers+sharegpt`): read in that order (spd.corpora.datastore.Stores).

Held out of both corpora explicitly, as they are held out of training: the everyday benchmark set's conversations
(every part of each), and any conversation whose user turns contain the opening of an eval prompt (none did when
this was written; the count is kept in the sharegpt file's metadata).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import sys

from spd.corpora.datastore import Datastore, Stores, load_documents, tokenizer_key
from spd.errors import UserError

SHAREGPT = "sharegpt"
ANSWERS = "answers"
ANSWERS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "datastore")
MAX_PROMPT_CHARS = 2000   # the answered prompts' longest first turn (characters)
OPENING = 80        # characters of an eval prompt (whitespace folded, lower case) that mark a conversation as its copy


def _folded(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip()


def usable_conversations(dropped: dict | None = None, log=print):
    """The ShareGPT conversations (record, turns) a datastore may read: none of the everyday set's (any part) and none
    whose user turns contain the opening of an eval prompt; `dropped` counts both."""
    from spd.corpora.prompts import DATASETS, load_questions
    from spd.corpora.sharegpt import _sharegpt_file, complete_records, held_out_ids, normalise

    dropped = {} if dropped is None else dropped
    dropped.update(everyday=0, eval=0)
    everyday = {record_id.rsplit("_", 1)[0] for record_id in held_out_ids()}
    openings = [_folded(q["turns"][0].replace("Complete the code I provided.", ""))[:OPENING]
                for ds in DATASETS for q in load_questions(ds)]
    openings = [o for o in openings if len(o) >= 30]
    for record in complete_records(_sharegpt_file(), log=log):
        if str(record.get("id", "")).rsplit("_", 1)[0] in everyday:
            dropped["everyday"] += 1
            continue
        messages = normalise(record) or []
        asked = _folded(" ".join(m["content"] for m in messages if m["role"] == "user"))
        if any(opening in asked for opening in openings):
            dropped["eval"] += 1
            continue
        yield record, messages


def sharegpt_documents(log=print) -> tuple[list[str], dict]:
    """The assistant turns a `sharegpt` datastore holds, and what was held out."""
    texts, dropped = [], {}
    for _, messages in usable_conversations(dropped, log):
        texts += [m["content"] for m in messages if m["role"] == "assistant" and m["content"].strip()]
    return texts, {"records_dropped": dropped, "documents": len(texts)}


def answer_prompts(log=print) -> list[tuple[str, str]]:
    """(record id, first user turn) of the usable conversations whose first user turn is under
    MAX_PROMPT_CHARS characters, in one fixed shuffled order: what bench/target_answers.py has the target answer,
    first to last (so a corpus of N answers is the first N of the same list on every machine)."""
    prompts = []
    for record, messages in usable_conversations(log=log):
        turn = next((m for m in messages if m["role"] == "user"), None)
        if turn and turn["content"].strip() and len(turn["content"]) < MAX_PROMPT_CHARS:
            prompts.append((str(record.get("id", "")), turn["content"]))
    random.Random(0).shuffle(prompts)
    return prompts


def _say(message: str) -> None:
    print(f"[spd] {message}", file=sys.stderr)


def answers_path(key: str) -> str:
    """The package's file of the answers of a target with this tokenizer (bench/target_answers.py writes it)."""
    return os.path.join(ANSWERS_DIR, f"{ANSWERS}-{key}.safetensors")


def open_datastore(spec: str, tokenizer, vocab_size: int, log=_say) -> Datastore | Stores:
    """`sharegpt` (built and cached per tokenizer), `answers` (the target's own, shipped), a datastore file, or
    several joined by `+`, read in that order (spd.corpora.datastore.Stores); refused where ids are another tokenizer's."""
    if "+" in spec and not os.path.isfile(spec):
        parts = spec.split("+")
        if not all(parts) or len(set(parts)) < len(parts):
            raise UserError(f"datastore={spec!r}: join distinct datastores with '+', e.g. {ANSWERS}+{SHAREGPT}")
        return Stores([_open_one(part, tokenizer, vocab_size, log) for part in parts])
    return _open_one(spec, tokenizer, vocab_size, log)


TEXT_SUFFIXES = (".txt", ".jsonl")


def text_documents(path: str, data: bytes) -> list[str]:
    """The documents of a user's text file (its bytes `data`): a .txt file whole, or each line's "text" of a .jsonl
    file."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"datastore={path!r} is not UTF-8 text; save it as UTF-8") from None
    if not path.endswith(".jsonl"):
        texts = [text] if text.strip() else []
    else:
        texts = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise UserError(f"datastore={path!r}: line {number} is not a JSON object with a \"text\" string; "
                                'write one {"text": ...} object a line')
            if record["text"].strip():
                texts.append(record["text"])
    if not texts:
        raise UserError(f"datastore={path!r} holds no text; give a file with the documents to draft from")
    return texts


def _text_datastore(path: str, tokenizer, key: str, separator: int, log) -> Datastore:
    """A user's text file as a datastore, built once per (file content, tokenizer) and cached."""
    from spd.targets.weight_cache import cache_root

    with open(path, "rb") as f:
        data = f.read()
    digest = hashlib.sha256(data).hexdigest()[:16]
    cached = os.path.join(cache_root(), "datastore", f"text-{digest}-{key}.safetensors")
    if os.path.isfile(cached):
        try:
            return Datastore.load(cached)
        except Exception as exc:        # damaged: built again below
            log(f"the cached datastore {cached} cannot be read ({exc}); building it again")
    texts = text_documents(path, data)
    log(f"building the datastore of {path} for this tokenizer once ({len(texts)} documents): {cached}")
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    store = Datastore.build(ids, separator, {"source": os.path.abspath(path), "sha256": digest, "tokenizer": key,
                                             "documents": len(texts)})
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    store.save(cached)
    return store


def _open_one(spec: str, tokenizer, vocab_size: int, log) -> Datastore:
    key = tokenizer_key(tokenizer)
    separator = max(vocab_size, len(tokenizer))
    if spec == ANSWERS:
        path = answers_path(key)
        if not os.path.isfile(path):
            raise UserError(f"datastore={ANSWERS}: no answers of a target with this tokenizer ship with the suite; "
                            f"write them with `python -m bench.target_answers`, or use datastore={SHAREGPT}")
        documents, meta = load_documents(path)
        return Datastore.build(documents, separator, meta)
    if spec == SHAREGPT:
        from spd.targets.weight_cache import cache_root

        path = os.path.join(cache_root(), "datastore", f"{SHAREGPT}-{key}.safetensors")
        if os.path.isfile(path):
            try:
                return Datastore.load(path)
            except Exception as exc:        # a file of an older format, or damaged: built again below
                log(f"the cached ShareGPT datastore {path} cannot be read ({exc}); building it again")
        else:
            log(f"building the ShareGPT datastore for this tokenizer once (about half a minute): {path}")
        texts, held = sharegpt_documents(log=lambda message: None)
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        store = Datastore.build(ids, separator, {"source": SHAREGPT, "tokenizer": key, **held})
        os.makedirs(os.path.dirname(path), exist_ok=True)
        store.save(path)
        return store
    if not os.path.isfile(spec):
        raise UserError(f"datastore={spec!r} is neither {SHAREGPT!r}, {ANSWERS!r}, a datastore file nor a .txt or "
                        ".jsonl file of text; give one of those, or several joined by '+' (or leave it unset: no "
                        "datastore)")
    if spec.endswith(TEXT_SUFFIXES):
        return _text_datastore(spec, tokenizer, key, separator, log)
    try:
        store = Datastore.load(spec)
    except Exception as exc:      # safetensors raises its own error types for a file that is not one of its own
        try:                      # a documents file (save_documents: an answers file of any size) sorts here
            documents, meta = load_documents(spec)
        except Exception:
            raise UserError(f"datastore={spec!r} is not a datastore file ({exc}); give a .txt or .jsonl file of "
                            "text, or build one with spd.corpora.datastore.Datastore.build(...).save(path)") from None
        store = Datastore.build(documents, separator, meta)
    if store.meta.get("tokenizer") != key:
        raise UserError(f"datastore={spec!r} holds ids of another tokenizer than this target's; build it for this "
                        "target's tokenizer")
    return store
