"""The prompt sets bench/wallclock.py times (the eval sets' first prompts, the everyday set), and what it reports per
set: each row's speedup against the set's fastest plain decoding, its worst prompt against AR, the greedy rows
checked token for token against the suite's AR, and how much of AR's greedy output repeats itself."""

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


KEYED = ("ar", "suffix", "lookup")        # single-process rows whose sampled draws are keyed


def summarise_set(rows: list[dict], prompts, args) -> dict:
    """Speedups against the fastest plain decoding of this set at each temperature (any dtype), greedy rows checked
    against the suite's AR in their own dtype (and sampled chains against its keyed samples), each row's worst prompt
    against that AR and against the fastest plain row, and how much of AR's greedy output repeats itself."""
    def plain(r):
        return r["method"] in ("ar", "hf_generate") and r["runtime"] == "single process" and r.get("keyed", True)

    fastest = {t: max((r for r in rows if plain(r) and r["temperature"] == t), key=lambda r: r["tokens_per_s"])
               for t in args.temperatures}
    ar = {(r.get("dtype", "float32"), r["temperature"]): r for r in rows
          if r["method"] == "ar" and r["runtime"] == "single process" and r.get("keyed", True)}
    reference = ar[("float32", 0.0)]["outputs"] if ("float32", 0.0) in ar else None
    outputs = {id(r): r["outputs"] for r in rows}
    for row in rows:
        dtype, t = row.get("dtype", "float32"), row["temperature"]
        own = ar.get((dtype, t), ar.get(("float32", t)))
        row["speedup_vs_fastest_plain"] = row["tokens_per_s"] / fastest[t]["tokens_per_s"]
        for name, against in (("worst_prompt_vs_ar", own), ("worst_prompt_vs_fastest_plain", fastest[t])):
            base = against["per_prompt_tokens_per_s"]
            ratios = {key: rate / base[key] for key, rate in row.get("per_prompt_tokens_per_s", {}).items()}
            if ratios:      # batched rows time their prompts together
                worst = min(ratios, key=ratios.get)
                row[name] = ratios[worst]
                if name == "worst_prompt_vs_ar":
                    row["worst_prompt"] = worst
        row["prompts"] = len(prompts)
        mine, theirs = outputs[id(row)], outputs[id(own)]
        if t == 0:  # lossless: every greedy row decodes AR's tokens (AR of its dtype)
            row["greedy_equals_ar"] = sum(mine[key] == ids for key, ids in theirs.items())
        elif row["method"] in KEYED and row.get("keyed", True) and row is not own:
            # keyed draws: a seeded request samples AR's own tokens (spd.verify.sampling.KeyedDraws)
            row["sampled_equals_ar"] = sum(mine[key] == ids for key, ids in theirs.items())
    for row in rows:
        row.pop("outputs")
    inside = positions = 0
    if reference is not None:
        for key, ids in prompts:
            inside += len(repeating(ids + reference[key], len(ids), REPEAT_SPAN))
            positions += len(reference[key])
    return {"prompts": len(prompts), "repeat_share": inside / positions if positions else None,
            "fastest_plain_tokens_per_s": {t: r["tokens_per_s"] for t, r in fastest.items()},
            "fastest_plain": {t: f"{r['method']} {r.get('dtype', 'float32')}" for t, r in fastest.items()}}
