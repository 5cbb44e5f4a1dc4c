"""FlowSpec's settings replayed over the target's greedy traces: L′acc and tokens per step by n, draft
source, segment S, children per node W and tree nodes N (depth 5), with the exact replay of `spd.eval.fast_trace`
(FlowSpec's own loop over the traces; no target forward). Every 8th of the 240 cached 512-token traces, cut to their
first 256 tokens (30 prompts).

    python -m experiments.flowspec_grid --traces outputs/cache/traces/greedy-e146e36482806c57 --out docs/results/flowspec_grid.json

The figure's page: docs/rivals.md, "By the clock".
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import sys

import torch

from spd.drafters.hybrid import segment_drafter
from spd.eval.fast import GreedyTrace
from spd.eval.fast_trace import fast_segment_eval
from spd.spec import DecodeKeys, DecodeSpec

LOOKUP = DecodeSpec.of(DecodeKeys()).lookup   # matches of 2..8 tokens, the keys' defaults


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", required=True, help="a trace cache directory of spd-infer eval (*.pt)")
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--out", default="docs/results/flowspec_grid.json")
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.join(args.traces, "*.pt")))[:: args.every][: args.prompts]
    traces = []
    for path in files:
        d = torch.load(path)
        traces.append(GreedyTrace(d["prompt_ids"], d["tokens"][: args.tokens], {}, d["margins"][: args.tokens]))
    rows = []
    for n, source, segment, width, nodes in itertools.product([2, 5], ["suffix", "lookup"], [1, 2, 4, 8], [1, 2, 4],
                                                              [8, 16]):
        if width == 1 and nodes == 16:
            continue
        tokens = steps = 0
        for trace in traces:
            stats = fast_segment_eval(trace, make_drafter=lambda: segment_drafter(draft_source=source, lookup=LOOKUP, memory=None),
                                      n=n, segment=segment, draft_length=5, width=width, tree_nodes=nodes,
                                      vocab=args.vocab)["stats"]
            tokens, steps = tokens + stats.N, steps + stats.K
        rows.append({"n": n, "draft_source": source, "segment": segment, "W": width, "tree_nodes": nodes,
                     "eal": n * tokens / steps, "tokens_per_step": tokens / steps})
        print(json.dumps(rows[-1]), file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "prompts": len(traces), "tokens": args.tokens, "traces": args.traces,
                   "command": " ".join(["python", *sys.argv])}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
