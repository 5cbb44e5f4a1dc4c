"""Where a cycle of the default goes outside the target's forward: the default on a CPU
(`method=suffix W=4 datastore=answers+sharegpt`, priced with this machine's row costs, as the clock builds
it) decodes the first prompts of a set, each right after the suite's AR on the same prompt, with `perf_counter`
around the parts of its cycle — drafting, the verification forward, settling — and inside them around the drafter's
and the sampler's steps; beforehand, what the vector operations of choosing a token cost over one logits vector.
Milliseconds a cycle for the default, a token for AR. The timers cost ~1 µs a call; the
parts measured inside one another overlap (drafting contains the best-first tries, the datastore, the predictions
and the keyed uniforms; settling contains the margin, the draws and the drafter's update).

    python -m experiments.cycle_parts --set eval --prompts 4 --temperature 1 --out docs/results/cycle_parts_intel.json

The figure's page: docs/speed-cpu.md, "The forward's row costs".
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch

from bench.default_build import default_decoder, first_prompts
from spd.decoding import Request, eos_ids_of
from spd.drafters import suffix
from spd.drafters.suffix import SuffixDrafter
from spd.engine import build_decoder
from spd.eval.output import write_json
from spd.methods import AR
from spd.pricing import AcceptancePredictor
from spd.runtime import chain, sequence
from spd.verify.sampling import KeyedDraws, greedy_token, top2_margin
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget
from bench.turns import params_for, seed_of

SECONDS: dict[str, float] = collections.defaultdict(float)


def vector_ops_us(vocab: int, calls: int = 2000) -> dict[str, float]:
    """Microseconds a call, warm, over one logits vector [vocab]: torch's argmax, top-2 and max beside the suite's
    block-maxima greedy token and top-2 margin (spd.verify.sampling)."""
    x = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    ops = {"torch.argmax": lambda: torch.argmax(x), "torch.topk(2)": lambda: torch.topk(x, 2), "torch.max": x.max,
           "spd.verify.sampling.greedy_token": lambda: greedy_token(x), "spd.verify.sampling.top2_margin": lambda: top2_margin(x)}
    out = {}
    for name, op in ops.items():
        for _ in range(50):
            op()
        start = time.perf_counter()
        for _ in range(calls):
            op()
        out[name] = 1e6 * (time.perf_counter() - start) / calls
    return out


def timed(owner, name: str, label: str) -> None:
    """Replace owner.name by the same callable adding its seconds to SECONDS[label]."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - start
    setattr(owner, name, wrapper)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--set", default="eval", choices=["eval", "everyday"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--datastore", default="answers+sharegpt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/results/cycle_parts.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_target(args.target)
    prompts = first_prompts(args.set, args.prompts, loaded.tokenizer)
    staged = StagedTarget(loaded.model, 1)
    drafter, default = default_decoder(loaded, staged, args.datastore)
    store = drafter.retrieval
    ar = build_decoder(AR, staged, eos_ids_of(loaded.model.config, loaded.tokenizer))
    params = params_for(args.temperature)
    vector_ops = vector_ops_us(loaded.model.config.vocab_size)     # before the timers go in

    timed(sequence.ChainSequence, "draft", "draft")
    timed(chain.ChainDecoder, "forward_tree", "forward")
    timed(sequence.ChainSequence, "settle", "settle")
    timed(suffix, "_best_first", "draft: best-first tries")
    timed(store.store, "continuations", "draft: datastore continuations")
    timed(AcceptancePredictor, "predict", "draft: predictions")
    timed(KeyedDraws, "uniform", "draft: keyed uniforms (drawing a position's uniforms included)")
    timed(sequence, "top2_margin", "settle: top-2 margin")
    timed(sequence, "settle_children", "settle: verdicts of drafted children")
    timed(sequence, "next_token", "settle: the target's own next token")
    timed(SuffixDrafter, "verified", "settle: the drafter's update")

    def run(decoder, key, ids):
        result = decoder.generate(ids, Request(args.max_new_tokens, params, seed_of(key), True))
        return len(result.token_ids), result.seconds

    run(ar, *prompts[0])                       # warm-up: the row-cost profile, the datastore, the kernels
    decoded = {"ar": [0, 0.0], "default": [0, 0.0]}          # tokens, seconds
    parts: collections.Counter = collections.Counter()       # the default's seconds in each timed part
    cycles = 0
    for key, ids in prompts:
        for name, decoder in (("ar", ar), ("default", default)):
            SECONDS.clear()
            before = drafter.cycles
            tokens, seconds = run(decoder, key, ids)
            decoded[name][0] += tokens
            decoded[name][1] += seconds
        parts.update(SECONDS)                                # the default's run, the last of the pair
        cycles += drafter.cycles - before
    ar_per_token, default_per_token = (seconds / tokens for tokens, seconds in decoded.values())
    out = {
        "command": " ".join(["python"] + sys.argv), "set": args.set, "prompts": len(prompts),
        "temperature": args.temperature, "cycles": cycles, "tokens": decoded["default"][0],
        "ar_ms_per_token": 1000 * ar_per_token,
        "default_ms_per_cycle": 1000 * decoded["default"][1] / cycles,
        "speedup": ar_per_token / default_per_token,
        "ms_per_cycle": {label: 1000 * value / cycles for label, value in parts.items()},
        "vector_ops_us": vector_ops,
    }
    for label, value in vector_ops.items():
        print(f"{label:70s} {value:7.1f} µs a call")
    for label, value in out["ms_per_cycle"].items():
        print(f"{label:70s} {value:7.3f} ms a cycle")
    print(f"AR {out['ar_ms_per_token']:.1f} ms a token; the default {out['default_ms_per_cycle']:.1f} ms a cycle, "
          f"{out['cycles']} cycles, {out['speedup']:.3f}x")
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
