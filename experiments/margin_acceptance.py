"""How often a context-statistics candidate of depth 1 is kept, by the target's top-2 logit margin at the newest
verified token, the candidate's share and its match length: the evidence the acceptance predictor (spd.pricing)
prices with, counted over the eval's cached greedy traces with the runtime's own priced drafter
(spd.eval.fast_chain.replay; every candidate is judged, drafted or not).

    python -m experiments.margin_acceptance --out docs/results/margin_acceptance.json

The figure's page: docs/speed-cpu.md, "How good the pricing is".
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

from tqdm import tqdm

from spd.config import load_config
from spd.drafters.suffix import SuffixDrafter
from spd.eval.config import EvalConfig
from spd.eval.output import write_json
from spd.eval.traces import TraceCache
from spd.eval.fast_chain import replay
from spd.pricing import MARGIN_EDGES, AcceptancePredictor
from spd.corpora.prompts import DATASETS, chat_prompt_ids, load_questions
from spd.session import open_session
from spd.targets.row_costs import cached_row_costs


class Counting(AcceptancePredictor):
    """The predictor, counting every depth-1 verdict into `table` on the way."""

    def __init__(self, table: dict):
        super().__init__()
        self.table = table

    def observe(self, e, kept):
        if e.depth == 1:
            margin = next((f"< {edge:g}" for edge in MARGIN_EDGES if e.margin < edge), f">= {MARGIN_EDGES[-1]:g}")
            share = "1" if e.share >= 0.999 else ">= 0.5" if e.share >= 0.5 else "< 0.5"
            cell = self.table[(margin, share, min(e.match, 3))]
            cell[0] += kept
            cell[1] += 1
        super().observe(e, kept)


class CountingDrafter(SuffixDrafter):
    """The runtime's priced drafter whose every request's fresh predictor counts into `table`."""

    def __init__(self, table: dict, costs):
        super().__init__(1, 8, costs)
        self.table = table

    def start(self, prompt_hidden, tokens):
        super().start(prompt_hidden, tokens)
        self.predictor = Counting(self.table)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=80, help="prompts per eval set")
    ap.add_argument("--out", default="docs/results/margin_acceptance.json")
    args = ap.parse_args()
    cfg = load_config(EvalConfig, "configs/eval/greedy.yaml", ["method=lookup"])    # loads no module; the traces are shared
    session = open_session(cfg)
    traces = TraceCache(cfg.trace_cache_dir, session.loaded, session.staged, cfg.max_new_tokens)
    costs = cached_row_costs(session.staged, 17)
    table: dict = defaultdict(lambda: [0, 0])
    work = [(ds, q) for ds in DATASETS for q in load_questions(ds)[: args.limit]]
    for ds, q in tqdm(work, desc="traces", unit="prompt"):
        trace, _ = traces.get(ds, q["question_id"], chat_prompt_ids(session.loaded.tokenizer, q["turns"][0]))
        replay(CountingDrafter(table, costs), trace.prompt_ids, trace.tokens, 15, 4, 16, margins=trace.margins)
    rows = [{"target_margin": m, "share": s, "match": f"{n}" if n < 3 else ">= 3", "kept": kept / seen, "verdicts": seen}
            for (m, s, n), (kept, seen) in sorted(table.items())]
    for row in rows:
        print(f"margin {row['target_margin']:6s} share {row['share']:6s} match {row['match']:4s} "
              f"kept {row['kept']:.2f} of {row['verdicts']}")
    write_json(args.out, {"rows": rows, "prompts": len(work), "command": " ".join(["python", *sys.argv])})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
