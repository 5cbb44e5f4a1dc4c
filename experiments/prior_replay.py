"""Which prior should a sampled request's acceptance predictor start from? The default on
a CPU (`method=suffix W=4 datastore=answers+sharegpt`, as the clock builds it) samples prompts of a set with
keyed draws and the greedy predictor's prior, recording, cycle by cycle, every candidate a cycle judges (its parent
was reached; drafted or not) with its evidence, its uniform and its verdict. Then each predictor setting is replayed
over that recording — a fresh predictor per request, each cycle's candidates predicted before its verdicts are
observed, as spd.drafters.suffix does — and scored by the verdicts' mean log-likelihood under the T = 1 pricing's
chance (spd.pricing.given_noise). The candidates and verdicts are the recording's: a setting that drafted
differently would have started some cycles elsewhere, so this compares predictors on the same questions, not
decodes. The recorded setting replays to the recording's own predictions (checked). The same replay weighs how much
of a context candidate's prior its recall decides (`--recall-weights`; "none": the recall left
out of the evidence, as before it), with the greedy prior and with for_sampling's.

    python -m experiments.prior_replay --set everyday --prompts 10 --out docs/results/prior_replay_everyday.json

The figure's page: docs/speed-cpu.md, "How good the pricing is".
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import torch
from tqdm import tqdm

from bench.default_build import default_decoder, first_prompts
from experiments.noise_calibration import Recording as NoiseRecording
from spd.decoding import Request
from spd.eval.output import write_json
from spd.pricing import AcceptancePredictor, given_noise
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget
from bench.turns import params_for, seed_of


class Recording(NoiseRecording):
    """The default's drafter, unchanged, noting per request and cycle each judged candidate: (evidence, u, kept,
    the chance it was priced at — to check the replay)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requests: list[list[list[tuple]]] = []

    def start(self, prompt_hidden, tokens) -> None:
        super().start(prompt_hidden, tokens)
        self.requests.append([])

    def note(self, nodes, evidence, judged) -> None:
        self.requests[-1].append([(evidence[i], self.priced[i][1], kept, self.priced[i][0]) for i, kept in judged])


def replay(requests, make, raw: list[float] | None = None) -> dict[str, float]:
    """Mean log-likelihood of the verdicts, and kept against predicted, for predictors made by `make` (their
    predictions before the noise appended to `raw` if given)."""
    ll = predicted = 0.0
    count = kept = 0
    for request in requests:
        predictor = make()
        for cycle in request:
            plain = [predictor.predict(e) for e, _, _, _ in cycle]
            if raw is not None:
                raw += plain
            chances = [given_noise(c, u) for c, (_, u, _, _) in zip(plain, cycle)]
            for (e, u, verdict, _), q in zip(cycle, chances):
                q = min(max(q, 1e-6), 1 - 1e-6)
                ll += math.log(q if verdict else 1 - q)
                predicted += q
                count += 1
                kept += verdict
            for e, _, verdict, _ in cycle:
                predictor.observe(e, verdict)
    return {"log_likelihood": ll / count, "kept": kept, "predicted": predicted, "verdicts": count}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--set", default="everyday", choices=["eval", "everyday"])
    ap.add_argument("--prompts", type=int, default=10, help="the set's first prompts (eval: MT-Bench's first)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--datastore", default="answers+sharegpt")
    ap.add_argument("--weights", default="2,4,8,16,32", help="prior_weight values")
    ap.add_argument("--scales", default="0.8,0.7,0.6,0.5", help="prior_scale values")
    ap.add_argument("--recall-weights", default="0,0.15,0.3,0.45,0.6,1", help="recall_weight values")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/prior_replay.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_target(args.target)
    prompts = first_prompts(args.set, args.prompts, loaded.tokenizer)
    drafter, default = default_decoder(loaded, StagedTarget(loaded.model, 1), args.datastore, Recording)
    for key, ids in tqdm(prompts, desc="prompts"):
        default.generate(ids, Request(args.max_new_tokens, params_for(1.0), seed_of(key)))
    # the recorded setting must replay to the recording's own predictions, or the replay is not the drafter's
    check, recorded = [], [chance for request in drafter.requests for cycle in request for *_, chance in cycle]
    greedy = replay(drafter.requests, AcceptancePredictor, check)
    if len(check) != len(recorded) or any(abs(a - b) > 1e-12 for a, b in zip(check, recorded)):
        raise SystemExit("the replay of the recorded predictor does not reproduce its predictions")
    settings = [{"prior_weight": float(w), "prior_scale": float(s)}
                for w in args.weights.split(",") for s in args.scales.split(",")]
    rows = []
    for setting in tqdm(settings, desc="settings"):
        rows.append({**setting, **replay(drafter.requests, lambda: AcceptancePredictor(**setting))})
    shipped = AcceptancePredictor.for_sampling()
    forgotten = [[[(dataclasses.replace(e, recall=math.nan), *rest) for e, *rest in cycle] for cycle in request]
                 for request in drafter.requests]
    recall = []
    for prior, setting in (("greedy", {}), ("for_sampling", {"prior_weight": shipped.prior_weight,
                                                              "prior_scale": shipped.prior_scale})):
        recall.append({"prior": prior, "recall_weight": "none",
                       **replay(forgotten, lambda: AcceptancePredictor(**setting))})
        recall += [{"prior": prior, "recall_weight": float(w),
                    **replay(drafter.requests, lambda: AcceptancePredictor(**setting, recall_weight=float(w)))}
                   for w in args.recall_weights.split(",")]
    out = {"command": " ".join(["python"] + sys.argv), "set": args.set, "prompts": [k for k, _ in prompts],
           "verdicts": len(recorded), "greedy_prior": greedy,
           "for_sampling": {"prior_weight": shipped.prior_weight, "prior_scale": shipped.prior_scale,
                            **replay(drafter.requests, AcceptancePredictor.for_sampling)},
           "settings": rows, "recall": recall,
           "with_recall": sum(e.recall == e.recall for request in drafter.requests for cycle in request
                              for e, *_ in cycle)}
    for name in ("greedy_prior", "for_sampling"):
        r = out[name]
        print(f"{name:>13s}: log-likelihood {r['log_likelihood']:.4f}, kept {r['kept']}, predicted {r['predicted']:.1f}")
    for r in rows:
        print(f"prior_weight {r['prior_weight']:4g}, prior_scale {r['prior_scale']:.2f}: log-likelihood "
              f"{r['log_likelihood']:.4f}, predicted {r['predicted']:.1f}")
    for r in recall:
        print(f"{r['prior']:>12s} prior, recall_weight {r['recall_weight']!s:>5s}: log-likelihood "
              f"{r['log_likelihood']:.4f}, predicted {r['predicted']:.1f}")
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
