"""The prompt sets bench/wallclock.py times (the eval sets' first prompts, the everyday set), and what it reports per
set: each row's speedup against the set's fastest plain decoding, its worst prompt against AR, the greedy rows
checked token for token against the suite's AR, and how much of AR's greedy output repeats itself."""

from __future__ import annotations

import json

from repetition import repeating
from spd.prompts import DATASETS, chat_prompt_ids, load_questions
from spd.sharegpt import EVERYDAY_PATH

REPEAT_SPAN = 32


def prompt_set(name: str, args, tokenizer) -> list[tuple[str, list[int]]]:
    if name == "eval":
        return [(f"{ds}/{q['question_id']}", chat_prompt_ids(tokenizer, q["turns"][0]))
                for ds in DATASETS for q in load_questions(ds)[: args.limit]]
    if name == "everyday":
        with open(EVERYDAY_PATH) as f:
            records = [json.loads(line) for line in f if line.strip()][: args.everyday_limit]
        return [(f"everyday/{r['id']}", chat_prompt_ids(tokenizer, r["prompt"])) for r in records]
    raise SystemExit(f"--sets: {name!r} is not a set; use eval and/or everyday")


KEYED = ("ar", "suffix", "lookup")        # single-process rows whose sampled draws are keyed


def summarise_set(rows: list[dict], prompts, args) -> dict:
    """Speedups against the fastest plain decoding of this set at each temperature, greedy rows checked against
    the suite's AR (and sampled chains against its keyed samples), each row's worst prompt against AR, and how much
    of AR's greedy output repeats itself."""
    fastest_ar = {t: max(r["tokens_per_s"] for r in rows if r["method"] in ("ar", "hf_generate")
                         and r["runtime"] == "single process" and r["temperature"] == t) for t in args.temperatures}
    ar = {t: next(r for r in rows if r["method"] == "ar" and r["runtime"] == "single process"
                  and r["temperature"] == t) for t in args.temperatures}
    reference = ar[0.0]["outputs"] if 0.0 in ar else None
    sampled = {t: ar[t]["outputs"] for t in ar if t}
    for row in rows:
        row["speedup_vs_fastest_plain"] = row["tokens_per_s"] / fastest_ar[row["temperature"]]
        base = ar[row["temperature"]]["per_prompt_tokens_per_s"]
        ratios = {key: rate / base[key] for key, rate in row.get("per_prompt_tokens_per_s", {}).items()}
        if ratios:      # batched rows time their prompts together
            worst = min(ratios, key=ratios.get)
            row["worst_prompt_vs_ar"], row["worst_prompt"] = ratios[worst], worst
        row["prompts"] = len(prompts)
        outputs = row.pop("outputs")
        if row["temperature"] == 0 and reference is not None:  # lossless: every greedy row decodes AR's tokens
            row["greedy_equals_ar"] = sum(outputs[key] == ids for key, ids in reference.items())
        elif row["temperature"] and row["method"] in KEYED and row.get("keyed", True) \
                and row is not ar[row["temperature"]]:
            # keyed draws: a seeded request samples AR's own tokens (spd.sampling.KeyedDraws)
            row["sampled_equals_ar"] = sum(outputs[key] == ids for key, ids in sampled[row["temperature"]].items())
    inside = positions = 0
    if reference is not None:
        for key, ids in prompts:
            inside += len(repeating(ids + reference[key], len(ids), REPEAT_SPAN))
            positions += len(reference[key])
    return {"prompts": len(prompts), "repeat_share": inside / positions if positions else None,
            "fastest_plain_tokens_per_s": fastest_ar}
