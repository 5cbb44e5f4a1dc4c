"""What one batched decoding step costs against its number of rows on this machine: `BatchDecoder.step` of plain AR
with B sequences of the same prompt (each its own cache), timed after warm-up steps, for each B.

    OMP_NUM_THREADS=2 python -m bench.batch_cost --out docs/results/batch_cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from spd.decoding import Request
from spd.engine import build_batch_decoder
from spd.methods import AR
from spd.corpora.prompts import chat_prompt_ids
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget

PROMPT = "Write a long essay about the history of the Roman empire and its fall."


def setup(target: str = "smollm2"):
    """(the whole target staged once, the prompt's ids, the target's name)."""
    torch.set_grad_enabled(False)
    loaded = load_target(target)
    return StagedTarget(loaded.model, 1), chat_prompt_ids(loaded.tokenizer, PROMPT), loaded.name


def step_seconds(staged, prompt: list[int], rows: int, warm: int, steps: int) -> float:
    """Seconds per step of `rows` sequences decoding `prompt`, after `warm` steps (their contexts grow meanwhile)."""
    decoder = build_batch_decoder(AR, staged, frozenset(), max_batch=rows)
    for _ in range(rows):
        decoder.submit(prompt, Request(warm + steps + 10))
    for _ in range(warm):
        decoder.step()
    start = time.perf_counter()
    for _ in range(steps):
        decoder.step()
    return (time.perf_counter() - start) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--warm", type=int, default=40)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    staged, prompt, name = setup(args.target)
    rows = []
    for b in (int(x) for x in args.rows.split(",")):
        step_s = step_seconds(staged, prompt, b, args.warm, args.steps)
        rows.append({"rows": b, "step_ms": step_s * 1e3, "tokens_per_s": b / step_s})
        print(f"{b} rows: {step_s * 1e3:.1f} ms per step, {b / step_s:.1f} tokens/s", file=sys.stderr)
    for row in rows:
        row["step_vs_one_row"] = row["step_ms"] / rows[0]["step_ms"]
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", *sys.argv]), "target": name, "prompt_tokens": len(prompt),
                   "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
