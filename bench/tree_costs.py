"""What a draft tree costs on this machine: EAGLE-3's cycle (draft passes, one target forward over every node, the
drafter's update) timed by `spd.eval.calibrate.calibrate_chain` for a chain and for dynamic trees of several sizes,
on the default target. The draft module is untrained: its time does not depend on its weights, and acceptance is
not measured here (no trained EAGLE-3 module is on this machine). A tree pays off where its τ gain exceeds
cycle_s(tree) / cycle_s(chain).

    python -m bench.tree_costs --out docs/results/tree_costs.json
"""

from __future__ import annotations

import argparse
import sys

from spd.config import load_config
from spd.eval.calibrate import calibrate_chain
from spd.eval.config import EvalConfig
from spd.eval.output import write_json
from spd.session import open_session


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft-length", type=int, default=5)
    ap.add_argument("--trees", default="1:5,4:8,4:16", help="W:nodes pairs (W = 1: the chain of draft-length)")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--out", default="docs/results/tree_costs.json")
    args = ap.parse_args()
    cfg = load_config(EvalConfig, "configs/eval/greedy.yaml", ["method=eagle3", "checkpoint=random"])
    session = open_session(cfg)
    rows = []
    for pair in args.trees.split(","):
        width, nodes = (int(x) for x in pair.split(":"))
        cal = calibrate_chain(session.staged, session.drafter(), session.params, args.draft_length, args.context,
                              args.repeats, width=width, budget=nodes)
        rows.append({"W": width, "tree_nodes": nodes, **cal})
    chain = rows[0]["cycle_s"]
    for r in rows:
        r["cycle_vs_first"] = r["cycle_s"] / chain
    write_json(args.out, {"rows": rows, "draft_length": args.draft_length, "command": " ".join(["python", *sys.argv])})
    print("| W | drafted nodes | rows | draft passes s | verify s | update s | cycle s | × the first row's cycle |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['W']} | {r['rows'] - 1} | {r['rows']} | {r['drafts_s']:.4f} | {r['verify_s']:.4f} | "
              f"{r['update_s']:.4f} | {r['cycle_s']:.4f} | {r['cycle_vs_first']:.2f} |")
    print(f"AR token: {rows[0]['ar_token_s']:.4f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
