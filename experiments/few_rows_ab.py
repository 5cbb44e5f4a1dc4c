"""Paired A/B of a whole batched decoding step with the few-row product on and off (`spd.targets.ragged.FEW_ROWS`,
on: every forward of 2..64 rows): bench/batch_cost.py's step, alternating off/on --repeats times in one run.

    OMP_NUM_THREADS=2 python -m experiments.few_rows_ab --out docs/results/few_rows_ab.json

The figure's page: docs/speed-cpu.md, "The forward's row costs".
"""

from __future__ import annotations

import argparse
import json
import sys

import spd.targets.ragged as ragged
from bench.batch_cost import setup, step_seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="2,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    staged, prompt, name = setup()
    chosen, runs = ragged.FEW_ROWS, []
    for _ in range(args.repeats):
        for on in (False, True):
            ragged.FEW_ROWS = range(2, 65) if on else range(0)
            row = {"few_rows_product": on, **{b: step_seconds(staged, prompt, int(b), 40, 15) * 1e3
                                              for b in args.rows.split(",")}}
            runs.append(row)
            print(row, file=sys.stderr)
    ragged.FEW_ROWS = chosen
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", *sys.argv]), "target": name, "unit": "ms per step", "runs": runs},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
