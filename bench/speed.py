"""Decoding speed on the real target, all figures from one process (ratios are what matter on noisy machines).

1. tokens/s of the project's AR decoding vs HF `generate` (greedy, same prompt, EOS ignored so both make the
   same number of tokens); target ratio >= 0.9.
2. SPD seconds per pipeline step vs one full-token target forward + one module forward; target ratio <= 1.2.

    python -m bench.speed [--tokens 128] [--repeats 3] [--n 5] [--out docs/results/speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from spd.decoding import Request, prefill
from spd.drafters.spd_module import ModuleDrafter
from spd.engine import build_decoder
from spd.layout import needed_layers
from spd.methods import AR, PIPELINE
from spd.models.module import SpeculationModule
from spd.runtime.schedule import first_step
from spd.runtime.views import step_view
from spd.verify.sampling import SamplingParams
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget

PROMPT = "Explain in a few paragraphs how a pipelined CPU executes instructions."


def best_of(fn, repeats):
    times = []
    out = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times), out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--out", default="docs/results/speed.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    loaded = load_target("smollm2")
    model, tok = loaded.model, loaded.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    greedy = SamplingParams()
    staged = StagedTarget(model, args.n)
    no_eos = frozenset()
    prompt_t = torch.tensor([ids])

    def hf():
        with torch.no_grad():
            return model.generate(prompt_t, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False)

    def ar():
        return build_decoder(AR, staged, no_eos).generate(ids, Request(args.tokens, greedy))

    module = SpeculationModule.from_target(staged, 1).eval()

    def spd():
        return build_decoder(PIPELINE, staged, no_eos, ModuleDrafter(module)).generate(ids, Request(args.tokens, greedy))

    # Warm up each path once, then interleave so drift hits all of them alike.
    hf(), ar(), spd()
    hf_t, ar_t, spd_t, spd_k = [], [], [], []
    for _ in range(args.repeats):
        t, _, _ = best_of(hf, 1); hf_t.append(t)
        t, _, _ = best_of(ar, 1); ar_t.append(t)
        t, _, res = best_of(spd, 1); spd_t.append(t); spd_k.append(res.stats.K)
    hf_tps = args.tokens / min(hf_t)
    ar_tps = args.tokens / min(ar_t)

    # Reference step cost: one full-token target forward (all layers + head) and one module forward, measured
    # on the same state a decoding step sees (prompt + tokens generated so far).
    ar_res = ar()
    seq = ids + ar_res.token_ids
    with torch.no_grad():
        # one prefill gives both the target's cache and the hidden states the drafter's memory rows need
        cache, _, captured = prefill(staged, seq[:-1], frozenset(needed_layers(staged.bounds)))
        drafter = ModuleDrafter(module)
        drafter.start(captured, seq[:-1])
        t = len(seq) - 1      # the newest token enters stage 1 alone (occupancy 1): the module reads its embedding
        view = step_view(first_step(t, args.n), seq, {t: {0: staged.embed(torch.tensor([[seq[-1]]]))}})

        def target_forward():
            out = staged.forward_all(torch.tensor([[seq[-1]]]), cache, start_pos=len(seq) - 1)
            cache.crop(len(seq) - 1)
            return staged.logits(out[0][0, -1])

        def module_forward():
            return drafter.draft_logits(view)

        reps = 30
        for _ in range(3):
            target_forward(); module_forward()
        t_target = min(best_of(target_forward, 1)[0] for _ in range(reps))
        t_module = min(best_of(module_forward, 1)[0] for _ in range(reps))
    # Steady state: the same module runs every step (its cost is kept) but drafts are forced to the target's own
    # tokens, so the pipeline stays full and every step advances n tokens, as in a well-trained deployment.
    from spd.drafters.reference import ReferenceDrafter

    def spd_full():
        inner = ModuleDrafter(module)
        oracle = ReferenceDrafter(ids + ar_res.token_ids + [0] * args.n, model.config.vocab_size, inner=inner)
        return build_decoder(PIPELINE, staged, no_eos, oracle).generate(ids, Request(args.tokens, greedy))

    spd_full()
    full_runs = [best_of(spd_full, 1) for _ in range(args.repeats)]
    prefill_t = min(best_of(lambda: staged.forward_all(torch.tensor([ids]), staged.new_cache()), 1)[0]
                    for _ in range(3))
    # Per step = (generate time - prefill) / K, so the one-off prefill does not dilute the step cost.
    spd_step = min((t - prefill_t) / res.stats.K for t, _, res in full_runs)
    spd_step_random = min((t - prefill_t) / k for t, k in zip(spd_t, spd_k))
    result = {
        "target": loaded.name, "tokens": args.tokens, "n": args.n, "repeats": args.repeats,
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cpus": os.cpu_count()},
        "hf_generate_tokens_per_s": hf_tps, "ar_tokens_per_s": ar_tps, "ar_over_hf": ar_tps / hf_tps,
        "spd_seconds_per_step": spd_step, "spd_steps_full_pipeline": full_runs[0][2].stats.K,
        "spd_seconds_per_step_random_module": spd_step_random, "spd_steps_random_module": spd_k[0],
        "prefill_seconds": prefill_t,
        "target_forward_seconds": t_target, "module_forward_seconds": t_module,
        "spd_step_over_reference": spd_step / (t_target + t_module),
        "raw": {"hf_seconds": hf_t, "ar_seconds": ar_t, "spd_seconds": spd_t},
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, args.out)
    print(json.dumps({k: v for k, v in result.items() if k not in ("raw", "machine")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
