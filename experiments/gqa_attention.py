"""What packing a GQA target's query heads as rows (spd.targets.gqa_attention) saves a verification forward on this
CPU, against transformers' SDPA path that repeats the K/V cache for a masked call of several rows. One process, one
target (float32, the suite's products), the two kernels taking turns on every shape, each forward right after a
one-row forward as a decode loop meets it: chains (causal rows after the cache) and trees (two branches under an
ancestor mask). Beside the clock, how far each kernel's logits sit from the one-row steps they verify (max
|difference| over rows) and whether every row's argmax agrees with them.

    python -m experiments.gqa_attention --out docs/results/gqa_attention_intel.json

The figure's page: docs/speed-cpu.md, "The forward's row costs".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from spd.eval.output import write_json
from spd.targets import gqa_attention
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget

KERNELS = {"packed": gqa_attention.KERNEL, "repeat_kv": "sdpa"}


def use(staged: StagedTarget, kernel: str) -> None:
    staged.packed_gqa = kernel == "packed"
    staged.config._attn_implementation = KERNELS[kernel]


def tree_of(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain of rows // 2 nodes and a second branch from the root: visible [r, r] bool and depths [r]."""
    visible = torch.tril(torch.ones(rows, rows, dtype=torch.bool))
    half = max(1, rows // 2)
    visible[half:, 1:half] = False
    return visible, visible.sum(1) - 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--rows", default="2,3,4,6,8,12,16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/gqa_attention.json")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    context = args.context
    with torch.no_grad():
        staged = StagedTarget(load_target(args.target).model, 1)
        if not staged.packed_gqa:
            raise SystemExit(f"{args.target}: its attention is not packed here (not a CPU GQA target on SDPA)")
        ids = torch.randint(staged.config.vocab_size, (1, context + max(rows)), generator=torch.Generator().manual_seed(0))
        cache = staged.new_cache(context + max(rows))
        staged.forward_all(ids[:, :context], cache, 0)

        def forward(r: int, shape: str) -> torch.Tensor:
            new = ids[:, context: context + r]
            if shape == "tree" and r > 1:
                visible, depths = tree_of(r)
                out, _ = staged.forward_all(new, cache, context, offsets=depths, visible=visible)
            else:
                out, _ = staged.forward_all(new, cache, context)
            logits = staged.logits(out[0])
            cache.crop(context)
            return logits

        use(staged, "packed")
        steps = []                               # the one-row steps a chain of max(rows) verifies
        for i in range(max(rows)):
            out, _ = staged.forward_all(ids[:, context + i: context + i + 1], cache, context + i)
            steps.append(staged.logits(out[0]))
        cache.crop(context)
        steps = torch.cat(steps)
        accuracy = {}
        for kernel in KERNELS:
            use(staged, kernel)
            for r in rows:
                got = forward(r, "chain")
                accuracy[f"{kernel} {r}"] = {"max_abs_vs_steps": float((got - steps[:r]).abs().max()),
                                             "argmax_agrees": bool((got.argmax(-1) == steps[:r].argmax(-1)).all())}
        cases = [(kernel, shape, r) for r in rows for shape in ("chain", "tree") for kernel in KERNELS]
        times = {case: [] for case in cases}
        for round_ in range(args.rounds + 1):
            for kernel, shape, r in cases:
                use(staged, kernel)
                forward(1, "chain")
                start = time.perf_counter()
                forward(r, shape)
                if round_:                       # the first round warms every shape up
                    times[(kernel, shape, r)].append(time.perf_counter() - start)
        use(staged, "packed")
        one = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            forward(1, "chain")
            one.append(time.perf_counter() - start)
    report = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__, "threads": args.threads,
              "context": context, "one_row_ms": 1e3 * statistics.median(one), "forward_ms": {}, "accuracy": accuracy}
    for kernel, shape, r in cases:
        report["forward_ms"].setdefault(f"{shape} {kernel}", {})[r] = 1e3 * statistics.median(times[(kernel, shape,
                                                                                                         r)])
    print(f"one row: {report['one_row_ms']:.1f} ms")
    for key, by_rows in report["forward_ms"].items():
        print(f"{key:18s}", " ".join(f"{r}:{ms:.1f}" for r, ms in by_rows.items()))
    for key, value in accuracy.items():
        print(f"{key:14s} max |logit - step| {value['max_abs_vs_steps']:.2e}, argmax agrees {value['argmax_agrees']}")
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
