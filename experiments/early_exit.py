"""How often the target's own early exit (its first k layers, final norm and head: PipeDec's draft model here,
`draft_layers=k`) picks the target's greedy token: top-1, top-4 and top-8 agreement at each k over
cached greedy traces (every 8th of the 240 eval prompts, 30 of them, first 256 tokens; one forward each).

    python -m experiments.early_exit --traces outputs/cache/traces/greedy-e146e36482806c57 --out docs/results/early_exit.json

The figure's page: docs/rivals.md, "By the clock".
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import torch

from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget

LAYERS = [1, 2, 3, 4, 6, 8, 10, 12, 15]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", required=True)
    ap.add_argument("--out", default="docs/results/early_exit.json")
    args = ap.parse_args()
    staged = StagedTarget(load_target().model, 1)
    files = sorted(glob.glob(os.path.join(args.traces, "*.pt")))[::8][:30]
    hits = {k: [0, 0, 0] for k in LAYERS}
    total = 0
    for path in files:
        d = torch.load(path)
        ids = torch.tensor([d["prompt_ids"] + d["tokens"][:256]])
        start = len(d["prompt_ids"])
        with torch.no_grad():
            final, captured = staged.forward_all(ids, None, capture=set(LAYERS))
            target = staged.logits(final[0, start - 1: -1]).argmax(-1)
            for k in LAYERS:
                top = staged.logits(captured[k][0, start - 1: -1]).topk(8, -1).indices
                hits[k][0] += (top[:, 0] == target).sum().item()
                hits[k][1] += (top[:, :4] == target[:, None]).any(-1).sum().item()
                hits[k][2] += (top == target[:, None]).any(-1).sum().item()
        total += len(target)
    out = {"positions": total, "prompts": len(files),
           "agreement": {k: {"top1": h[0] / total, "top4": h[1] / total, "top8": h[2] / total} for k, h in hits.items()},
           "command": " ".join(["python", *sys.argv])}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["agreement"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
