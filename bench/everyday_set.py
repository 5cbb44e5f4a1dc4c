"""The everyday benchmark set: 30 first user turns of ShareGPT conversations, from the end of the
packaged file, English, 20..1,500 characters, one per conversation; written to spd/assets/eval/everyday/ with each
record's id. Training never sees them: spd.train.data drops these ids from every ShareGPT load (held out
explicitly — the GPU-trained module's extract reached the end of the file before this set existed, so SPD rows on
this set are not held-out for that module; the model-free drafters have nothing to leak).

    python -m bench.everyday_set
"""

from __future__ import annotations

import argparse
import json
import os

from spd.corpora.sharegpt import EVERYDAY_PATH, _sharegpt_file, complete_records, normalise


def english(text: str) -> bool:
    return sum(ch.isascii() for ch in text) >= 0.97 * len(text) and sum(ch.isalpha() for ch in text) > 10


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=30)
    ap.add_argument("--out", default=EVERYDAY_PATH)
    args = ap.parse_args()
    records = list(complete_records(_sharegpt_file(), log=lambda m: None))
    chosen, seen = [], set()
    for record in reversed(records):
        base = record["id"].rsplit("_", 1)[0]           # one turn per conversation (ids are <conv>_<part>)
        messages = normalise(record)
        if base in seen or not messages or messages[0]["role"] != "user":
            continue
        text = messages[0]["content"].strip()
        if not 20 <= len(text) <= 1500 or not english(text) or "continue" in text.lower()[:40]:
            continue
        seen.add(base)
        chosen.append({"id": record["id"], "prompt": text})
        if len(chosen) == args.count:
            break
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        for row in chosen:
            f.write(json.dumps(row) + "\n")
    os.replace(args.out + ".tmp", args.out)
    print(f"{len(chosen)} everyday prompts -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
