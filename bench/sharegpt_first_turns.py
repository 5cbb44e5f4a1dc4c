"""The prompt file the regenerated training data was made from: the first user turn (with any system turn before
it) of the first 9,000 ShareGPT records that have a non-empty one of at most 1,500 characters, each with a
placeholder reply that `data.regenerate=true` replaces by the target's own.

    python -m bench.sharegpt_first_turns --out outputs/data/sharegpt_first_turns.jsonl
then (a GPU makes this minutes instead of hours):
    python train/run.py --config configs/train/smollm2_n5_regen.yaml data.path=outputs/data/sharegpt_first_turns.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import os

from spd.corpora.sharegpt import _sharegpt_file, complete_records, normalise
from spd.train.regenerate import first_prompt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=9000)
    ap.add_argument("--max-chars", type=int, default=1500)
    ap.add_argument("--out", default="outputs/data/sharegpt_first_turns.jsonl")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    written = 0
    with open(args.out + ".tmp", "w") as f:
        for record in complete_records(_sharegpt_file(), log=lambda m: None):
            messages = normalise(record)
            prompt = first_prompt(messages) if messages else []
            if not prompt or not prompt[-1]["content"].strip() or len(prompt[-1]["content"]) > args.max_chars:
                continue
            f.write(json.dumps({"messages": prompt + [{"role": "assistant", "content": "(to be regenerated)"}]}) + "\n")
            written += 1
            if written == args.count:
                break
    os.replace(args.out + ".tmp", args.out)
    print(f"{written} first turns -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
