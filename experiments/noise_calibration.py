"""How far a candidate's own noise should move its price at T = 1: the default on a CPU
(`method=suffix W=4 datastore=answers+sharegpt`, as the clock builds it) samples prompts of a set with keyed
draws, and every candidate a cycle judges (drafted or not: its parent was reached) is recorded with the predictor's
unconditional chance π, its uniform u at its position and whether it was kept. One decode prices every share on the
same candidates (a different share would have drafted differently and started some cycles elsewhere, so this compares
the shares' predictions on the same questions, not their decodes).

For each share s of spd.pricing.given_noise — (1 - s) π + s u^((1 - π)/π); s = 1 is the Gumbel formula alone, s = 0
ignores the noise — the mean log-likelihood and Brier score of the verdicts, and, per bin of the formula's chance, how
many were kept against how many the formula and the shipped share predicted; and the predictor's own calibration
before any noise (kept against the sum of π per bin of π, and per source and depth).

    python -m experiments.noise_calibration --set everyday --prompts 10 --out docs/results/noise_calibration_everyday.json

The figure's page: docs/speed-cpu.md, "How good the pricing is".
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from tqdm import tqdm

from bench.default_build import default_decoder, first_prompts
from spd.decoding import Request
from spd.drafters.suffix import SuffixDrafter, judged
from spd.eval.output import write_json
from spd.pricing import NOISE_SHARE, AcceptancePredictor, given_noise
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget
from bench.turns import params_for, seed_of

BINS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Recording(SuffixDrafter):
    """The default's drafter, unchanged, noting each cycle's candidates and, once the cycle settles, their verdicts
    (`note`, called per cycle with [(candidate index, kept)]; experiments/prior_replay.py notes more)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.verdicts: list[tuple[str, int, float, float, bool]] = []    # (source, depth, π, u, kept)
        self.priced: list[tuple[float, float]] = []                     # per candidate: (π, u)

    def propose(self, cycle, choose=None):
        tree = super().propose(cycle, choose)
        nodes, evidence = self.last
        at = len(self.index.tokens) - 1          # the root's position, as the drafter priced it
        self.priced = [(self.predictor.predict(e), self.draws.uniform(at + node.depth, node.token))
                       for e, node in zip(evidence, nodes)]
        return tree

    def _learn(self, nodes, evidence, new):
        self.note(nodes, evidence, judged(nodes, new))
        super()._learn(nodes, evidence, new)

    def note(self, nodes, evidence, judged) -> None:
        self.verdicts += [(evidence[i].source, nodes[i].depth, *self.priced[i], kept) for i, kept in judged]


class SampledPriorRecording(Recording):
    """--sampled-prior: a sampled request's predictor starts from AcceptancePredictor.for_sampling's prior instead of
    the greedy one, while it has judged nothing (the default drafter does not)."""

    def sampling_draws(self, draws) -> None:
        super().sampling_draws(draws)
        if draws is not None and not self.predictor.counts:
            self.predictor = AcceptancePredictor.for_sampling()


def binned(verdicts, value):
    """[([lo, hi], the verdicts whose value falls in it)] over BINS, empty bins left out (1.0 in the last bin)."""
    out = []
    for lo, hi in zip(BINS, BINS[1:]):
        inside = [v for v in verdicts if lo <= value(v) < hi or (hi == 1.0 and value(v) >= 1.0)]
        if inside:
            out.append(([lo, hi], inside))
    return out


def scores(verdicts, share: float | None) -> dict[str, float]:
    """Mean log-likelihood and Brier score of the verdicts under a share (None: π alone)."""
    ll = brier = 0.0
    for _, _, chance, u, kept in verdicts:
        q = chance if share is None else given_noise(chance, u, share)
        q = min(max(q, 1e-6), 1 - 1e-6)
        ll += math.log(q if kept else 1 - q)
        brier += (q - kept) ** 2
    return {"log_likelihood": ll / len(verdicts), "brier": brier / len(verdicts)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--set", default="everyday", choices=["eval", "everyday"])
    ap.add_argument("--prompts", type=int, default=10, help="the set's first prompts")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--datastore", default="answers+sharegpt")
    ap.add_argument("--shares", default="0,0.2,0.3,0.35,0.4,0.5,0.7,1")
    ap.add_argument("--sampled-prior", action="store_true", help="a sampled request's predictor from "
                    "spd.pricing.AcceptancePredictor.for_sampling (not the default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/noise_calibration.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_target(args.target)
    prompts = first_prompts(args.set, args.prompts, loaded.tokenizer)
    drafter, default = default_decoder(loaded, StagedTarget(loaded.model, 1), args.datastore,
                                       SampledPriorRecording if args.sampled_prior else Recording)
    tokens = 0
    for key, ids in tqdm(prompts, desc="prompts"):
        tokens += len(default.generate(ids, Request(args.max_new_tokens, params_for(1.0), seed_of(key))).token_ids)
    verdicts = drafter.verdicts
    by_share = {"none (π alone)": scores(verdicts, None)}
    by_share.update({f"{float(s):g}": scores(verdicts, float(s)) for s in args.shares.split(",")})
    bins = [{"formula_chance": edges, "candidates": len(inside), "kept": sum(v[4] for v in inside),
             "predicted_by_formula": sum(given_noise(c, u, 1.0) for _, _, c, u, _ in inside),
             "predicted_by_shipped_share": sum(given_noise(c, u) for _, _, c, u, _ in inside)}
            for edges, inside in binned(verdicts, lambda v: given_noise(v[2], v[3], 1.0))]
    # the predictor's own calibration, before any noise: kept against the sum of π
    by_chance = [{"chance": edges, "candidates": len(inside), "kept": sum(v[4] for v in inside),
                  "predicted": sum(v[2] for v in inside)} for edges, inside in binned(verdicts, lambda v: v[2])]
    by_source = []
    for source, depth in sorted({(v[0], min(v[1], 3)) for v in verdicts}):
        inside = [v for v in verdicts if (v[0], min(v[1], 3)) == (source, depth)]
        by_source.append({"source": source, "depth": depth if depth < 3 else "3+", "candidates": len(inside),
                          "kept": sum(v[4] for v in inside), "predicted": sum(v[2] for v in inside)})
    out = {"command": " ".join(["python"] + sys.argv), "set": args.set, "prompts": len(prompts), "tokens": tokens,
           "verdicts": len(verdicts), "kept": sum(v[4] for v in verdicts), "shipped_share": NOISE_SHARE,
           "predictor": "for_sampling" if args.sampled_prior else "greedy prior",
           "scores": by_share, "bins": bins, "by_chance": by_chance, "by_source": by_source}
    for name, s in by_share.items():
        print(f"share {name:>16s}: log-likelihood {s['log_likelihood']:.4f}, Brier {s['brier']:.4f}")
    for b in bins:
        print(f"formula chance [{b['formula_chance'][0]:.2f}, {b['formula_chance'][1]:.2f}): {b['candidates']:5d} "
              f"candidates, kept {b['kept']:4d}, the formula {b['predicted_by_formula']:7.1f}, "
              f"the shipped share {b['predicted_by_shipped_share']:7.1f}")
    for b in by_chance:
        print(f"the predictor's chance [{b['chance'][0]:.2f}, {b['chance'][1]:.2f}): {b['candidates']:5d} candidates, "
              f"kept {b['kept']:4d}, predicted {b['predicted']:7.1f}")
    for b in by_source:
        print(f"{b['source']:>9s} at depth {b['depth']}: {b['candidates']:5d} candidates, kept {b['kept']:4d}, "
              f"predicted {b['predicted']:7.1f}")
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
