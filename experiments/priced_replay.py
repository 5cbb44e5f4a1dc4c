"""Priced drafting replayed over the target's greedy traces: for each drafter (the lookup chain, the priced context
statistics at each W), its exact greedy cycles (spd.eval.fast_chain.replay) over the eval's cached 512-token
traces, priced with this machine's row costs (spd.targets.row_costs, the profile the runtime uses): τ, rows per
cycle, the share of cycles drafted, and the predicted speedup over AR = tokens × cost(1 row) / Σ cost(rows of each
cycle) — on all positions and on the first --heads tokens of each answer (128 unless asked). bench/clock.py
checks the winners by the clock.

    spd-infer eval --config configs/eval/greedy.yaml           # records the 240 traces once (the trace cache)
    python -m experiments.priced_replay --out docs/results/priced_replay.json

The figure's page: docs/speed-cpu.md, "How good the pricing is".
"""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from spd.config import load_config
from spd.drafters.lookup import LookupDrafter
from spd.drafters.suffix import Retrieval, SuffixDrafter
from spd.corpora.retrieval import open_datastore
from spd.eval.config import EvalConfig
from spd.eval.output import write_json
from spd.eval.traces import TraceCache
from spd.eval.fast_chain import replay
from spd.corpora.prompts import DATASETS, chat_prompt_ids, load_questions
from spd.session import open_session
from spd.verify.sampling import Proposal
from spd.targets.row_costs import cached_row_costs
from spd.verify.tree import DraftTree


class HindsightSuffix(SuffixDrafter):
    """The ceiling of the context statistics on this machine: each cycle it knows the trace, so it drafts exactly
    the candidates that will be kept (the best-first tree walked along the trace) when those rows pay, else none."""

    def __init__(self, reference: list[int], costs, retrieval=None):
        super().__init__(1, 8, costs, retrieval=retrieval)
        self.reference = reference

    def propose(self, cycle, choose=None):
        root, m, width, budget = cycle.root, cycle.m, cycle.width, cycle.budget
        if cycle.margin is not None:
            self.margin = cycle.margin
        nodes, _ = self.candidates(m, width, budget)
        start, path, parent = len(self.index), [], -1
        while start + len(path) < len(self.reference):
            child = next((i for i, node in enumerate(nodes) if node.parent == parent
                          and node.token == self.reference[start + len(path)]), None)
            if child is None:
                break
            path.append(child)
            parent = child
        rows = min(range(len(path) + 1, 0, -1), key=lambda r: self.costs.seconds[r - 1] / min(r, len(path) + 1))
        tree = DraftTree(root)
        for node in path[: rows - 1]:
            tree.add(len(tree) - 1, Proposal(nodes[node].token, source="suffix"))
        return tree


def priced(drafter, trace, m: int, width: int, budget: int, costs, head: int | None) -> tuple[int, float, int, int]:
    """(tokens, seconds, cycles, rows) of the replay, cut to the first `head` tokens when given."""
    tokens = trace.tokens[:head] if head else trace.tokens
    out = replay(drafter, trace.prompt_ids, tokens, m, width, budget, margins=trace.margins)
    rows = out["rows_per_cycle"]
    return len(tokens), sum(costs.seconds[min(r, costs.max_rows) - 1] for r in rows), len(rows), sum(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=80, help="prompts per eval set")
    ap.add_argument("--suffix-widths", default="1,4")
    ap.add_argument("--suffix-length", type=int, default=15)
    ap.add_argument("--tree-nodes", type=int, default=16)
    ap.add_argument("--lookup-length", type=int, default=7)
    ap.add_argument("--heads", default="128", help="also each answer's first tokens alone, at these lengths")
    ap.add_argument("--datastore", default=None, help="e.g. sharegpt: each suffix row also with this datastore")
    ap.add_argument("--out", default="docs/results/priced_replay.json")
    args = ap.parse_args()
    heads = [int(h) for h in args.heads.split(",") if h]
    cfg = load_config(EvalConfig, "configs/eval/greedy.yaml", ["method=lookup"])
    session = open_session(cfg)
    traces = TraceCache(cfg.trace_cache_dir, session.loaded, session.staged, cfg.max_new_tokens)
    costs = cached_row_costs(session.staged, args.tree_nodes + 1)
    configs = {f"lookup m={args.lookup_length}": (lambda: LookupDrafter(2, 8), args.lookup_length, 1,
                                                 args.lookup_length)}
    retrieval = Retrieval(open_datastore(args.datastore, session.loaded.tokenizer,
                                         session.loaded.model.config.vocab_size)) if args.datastore else None
    for width in [int(w) for w in args.suffix_widths.split(",") if w]:
        budget = args.tree_nodes if width > 1 else args.suffix_length
        configs[f"suffix W={width}"] = (lambda: SuffixDrafter(1, 8, costs), args.suffix_length, width, budget)
        if retrieval is not None:
            configs[f"suffix W={width} + datastore"] = (lambda: SuffixDrafter(1, 8, costs, retrieval=retrieval),
                                                        args.suffix_length, width, budget)
    totals: dict = {}
    work = [(ds, q) for ds in DATASETS for q in load_questions(ds)[: args.limit]]
    for ds, q in tqdm(work, desc="traces", unit="prompt"):
        trace, _ = traces.get(ds, q["question_id"], chat_prompt_ids(session.loaded.tokenizer, q["turns"][0]))
        reference = list(trace.prompt_ids) + trace.tokens
        hindsight = {f"hindsight ceiling, suffix W={width}": (lambda: HindsightSuffix(reference, costs),
                                                               args.suffix_length, width, args.tree_nodes)
                     for width in (1, 4)}
        if retrieval is not None:      # the ceiling of the statistics and the datastore's candidates together
            hindsight["hindsight ceiling, suffix W=4 + datastore"] = (
                lambda: HindsightSuffix(reference, costs, retrieval), args.suffix_length, 4, args.tree_nodes)
        for name, (make, m, width, budget) in {**configs, **hindsight}.items():
            for head in (None, *heads):
                got = priced(make(), trace, m, width, budget, costs, head)
                key = (name, head)
                totals[key] = [a + b for a, b in zip(totals.get(key, [0, 0.0, 0, 0]), got)]
    rows = []
    for (name, head), (tokens, seconds, cycles, fed) in totals.items():
        rows.append({"drafter": name, "positions": f"first {head}" if head else "all", "tokens": tokens,
                     "tau": tokens / cycles, "rows_per_cycle": fed / cycles,
                     "predicted_speedup": tokens * costs.seconds[0] / seconds})
        print(f"{name:18s} {rows[-1]['positions']:9s} tau {rows[-1]['tau']:.3f} rows/cycle "
              f"{rows[-1]['rows_per_cycle']:.2f} predicted {rows[-1]['predicted_speedup']:.3f}x")
    write_json(args.out, {"rows": rows, "row_costs_s": list(costs.seconds), "prompts": len(work),
                          "command": " ".join(["python", *sys.argv])})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
