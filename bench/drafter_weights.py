"""Paired A/B of EAGLE-3's module beside the context statistics (`method=eagle3 draft_source=suffix+module`) with its
weights as they are (float32) and as int8 (torch's dynamic quantization of its Linear layers: drafts are proposals,
so the target's output is unchanged), beside the suite's AR and the default (the priced statistics, W = 4). Rows
alternate within each round, so a slow moment of the machine is shared; the drafter's candidate time is timed.

    python bench/drafter_weights.py --eagle3 outputs/gpu/20261127-161823/eagle3 --set everyday --limit 8 \\
        --temperatures 1 --out docs/results/drafter_weights.json
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import types
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from spd.config import GenerateConfig, load_config  # noqa: E402
from spd.decoding import Request  # noqa: E402
from spd.drafters.suffix import SuffixDrafter  # noqa: E402
from spd.engine import build_decoder, pick_decoder  # noqa: E402
from spd.eval.output import write_json  # noqa: E402
from spd.methods import AR, CHAIN  # noqa: E402
from spd.session import open_session  # noqa: E402
from spd.targets.row_costs import cached_row_costs  # noqa: E402
from wallclock import decode_all, params_for, seed_of  # noqa: E402
from wallclock_sets import prompt_set  # noqa: E402


def int8_copy(module: torch.nn.Module) -> torch.nn.Module:
    with warnings.catch_warnings():      # torch.ao's eager quantization is deprecated in favour of torchao
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(module), {torch.nn.Linear}, dtype=torch.qint8)


def timed_candidates(drafter) -> types.SimpleNamespace:
    clock = types.SimpleNamespace(seconds=0.0, calls=0)
    inner = drafter.candidates

    def candidates(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        clock.seconds, clock.calls = clock.seconds + time.perf_counter() - start, clock.calls + 1
        return out
    drafter.candidates = candidates
    return clock


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--eagle3", required=True, help="an EAGLE-3 checkpoint directory")
    ap.add_argument("--set", default="everyday", help="everyday or eval (bench/wallclock_sets.py)")
    ap.add_argument("--limit", type=int, default=8, help="prompts (eval: per data set)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperatures", default="1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.cores)
    cfg = load_config(GenerateConfig, None, ["target=smollm2", "method=eagle3", f"checkpoint={args.eagle3}", "W=4",
                                             "tree_nodes=8", "draft_source=suffix+module", "draft_length=15"])
    session = open_session(cfg)
    staged, eos = session.staged, session.eos_ids
    prompts = prompt_set(args.set, types.SimpleNamespace(limit=args.limit, everyday_limit=args.limit),
                         session.loaded.tokenizer)
    costs = cached_row_costs(staged, 9)
    decoders, clocks = {"ar": build_decoder(AR, staged, eos),
                        "suffix_w4 (the default)": build_decoder(CHAIN, staged, eos, SuffixDrafter(1, 8, costs),
                                                                 draft_length=15, width=4, tree_nodes=8)}, {}
    for name, int8 in (("suffix+eagle3 float32", False), ("suffix+eagle3 int8", True)):
        drafter = session.drafter()
        if int8:
            drafter.eagle.module = int8_copy(drafter.eagle.module)
        clocks[name] = timed_candidates(drafter)
        decoders[name] = pick_decoder("eagle3", cfg, session, None, drafter)
    rows = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        totals = {name: {"tokens": 0, "seconds": 0.0} for name in decoders}
        for clock in clocks.values():
            clock.seconds, clock.calls = 0.0, 0
        for _ in range(args.rounds):
            for name, decoder in decoders.items():
                out = decode_all(prompts, lambda key, ids: decoder.generate(
                    ids, Request(args.max_new_tokens, params_for(temperature), seed_of(key))))
                totals[name]["tokens"] += out["tokens"]
                totals[name]["seconds"] += out["seconds"]
                totals[name].update({k: out[k] for k in ("tau", "rows_per_cycle") if k in out})
        ar_rate = totals["ar"]["tokens"] / totals["ar"]["seconds"]
        for name, total in totals.items():
            rate = total["tokens"] / total["seconds"]
            row = {"row": name, "temperature": temperature, "tokens_per_s": rate, "vs_ar": rate / ar_rate, **total}
            if name in clocks:
                row["candidates_ms_per_cycle"] = 1e3 * clocks[name].seconds / max(clocks[name].calls, 1)
            rows.append(row)
            print(row, file=sys.stderr)
    write_json(args.out, {"command": " ".join(["python", *sys.argv]), "row_costs_s": list(costs.seconds),
                          "set": args.set, "prompts": len(prompts), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
