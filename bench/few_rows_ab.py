"""Paired A/B of a whole batched decoding step with the few-row product on and off (`spd.targets.ragged.FEW_ROWS`):
plain AR, B sequences of one prompt, steps timed after warm-up, alternating off/on --repeats times in one run.

    OMP_NUM_THREADS=2 python bench/few_rows_ab.py --out docs/results/few_rows_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import spd.targets.ragged as ragged  # noqa: E402
from spd.decoding import Request  # noqa: E402
from spd.engine import build_batch_decoder  # noqa: E402
from spd.methods import AR  # noqa: E402
from spd.prompts import chat_prompt_ids  # noqa: E402
from spd.targets.loading import load_target  # noqa: E402
from spd.targets.stages import StagedTarget  # noqa: E402

PROMPT = "Write a long essay about the history of the Roman empire and its fall."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="2,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    loaded = load_target("smollm2")
    staged = StagedTarget(loaded.model, 1)
    prompt = chat_prompt_ids(loaded.tokenizer, PROMPT)
    chosen, runs = ragged.FEW_ROWS, []
    for _ in range(args.repeats):
        for on in (False, True):
            ragged.FEW_ROWS = range(2, 65) if on else range(0)
            row = {"few_rows_product": on}
            for b in (int(x) for x in args.rows.split(",")):
                decoder = build_batch_decoder(AR, staged, frozenset(), max_batch=b)
                for _ in range(b):
                    decoder.submit(prompt, Request(80))
                for _ in range(40):
                    decoder.step()
                start = time.perf_counter()
                for _ in range(15):
                    decoder.step()
                row[str(b)] = (time.perf_counter() - start) / 15 * 1e3
            runs.append(row)
            print(row, file=sys.stderr)
    ragged.FEW_ROWS = chosen
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", *sys.argv]), "unit": "ms per step", "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
