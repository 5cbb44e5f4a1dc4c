"""The prompt sets the benchmarks time (the eval sets' first prompts, the everyday set), and how much of an answer
repeats itself (a span of tokens seen before in the prompt or the answer: what a context drafter can find)."""

from __future__ import annotations

import json

from spd.corpora.prompts import DATASETS, chat_prompt_ids, load_questions
from spd.corpora.sharegpt import EVERYDAY_PATH

REPEAT_SPAN = 32


def repeating(seq: list[int], prompt_len: int, span: int) -> set[int]:
    """Generated positions p whose window seq[p - span + 1 .. p] occurred, ending earlier, in seq."""
    seen, out = set(), set()
    for end in range(span, len(seq) + 1):
        window = tuple(seq[end - span: end])
        if window in seen and end - 1 >= prompt_len:
            out.add(end - 1)
        seen.add(window)
    return out


def prompt_set(name: str, args, tokenizer) -> list[tuple[str, list[int]]]:
    if name == "eval":
        return [(f"{ds}/{q['question_id']}", chat_prompt_ids(tokenizer, q["turns"][0]))
                for ds in DATASETS for q in load_questions(ds)[: args.limit]]
    if name == "everyday":
        with open(EVERYDAY_PATH) as f:
            records = [json.loads(line) for line in f if line.strip()][: args.everyday_limit]
        return [(f"everyday/{r['id']}", chat_prompt_ids(tokenizer, r["prompt"])) for r in records]
    raise SystemExit(f"--sets: {name!r} is not a set; use eval and/or everyday")
