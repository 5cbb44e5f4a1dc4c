"""What a decoding loop costs the host, per generated token, on a target whose forward costs almost nothing (a tiny
random Llama, 2 layers, d = 64): the time left is the loop's own — drafting, acceptance, bookkeeping, launches — the
part a GPU does not hide. One process, every row taking turns on the same prompts:

- transformers `generate` with its dynamic and its static cache (the plain decoding a user has);
- the suite's AR today (the eager loop) and through the device step (spd.runtime.device_step: eager, and compiled
  with `--compile`);
- every speculative method today and through the device step: the context lookup's chain, the priced context
  statistics' chain and the default's trees (W = 4), EAGLE-3's chain (its module drafting inside the step),
  Self-Draft (its branch rows fixed rows of the step), SPD's pipeline with n = 2 (its whole pipeline step on the
  device).

Each method's rows share its drafter and target, so the today/device pair of a method compares at the same tau;
the table reports tau and the host time per cycle (tau-free) beside the time per token. The prefill is left out:
a row's time per token is (t(N) - t(1)) / (N - 1), the same prompt decoded to N tokens and to 1.

    python -m bench.overhead --out docs/results/overhead.json [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spd.runtime.ar import ARDecoder
from spd.decoding import Request
from spd.drafters.eagle3 import Eagle3Drafter
from spd.drafters.eagle3_device import Eagle3DeviceDrafter
from spd.drafters.lookup import LookupDrafter
from spd.drafters.selfdraft import SelfDraftDrafter
from spd.drafters.spd_module import ModuleDrafter
from spd.drafters.suffix import SuffixDrafter
from spd.models.eagle3 import Eagle3Module
from spd.eval.output import write_json
from spd.methods import METHODS
from spd.models.module import SpeculationModule
from spd.runtime.chain import ChainDecoder
from spd.runtime.device_chain import DeviceChainDecoder
from spd.runtime.device_pipeline import DevicePipelineDecoder
from spd.runtime.pipeline import PipelineDecoder
from spd.verify.sampling import SamplingParams
from spd.targets.linears import plain_products
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model

K = 7       # the lookup's drafts a cycle (spd.methods: method=lookup's draft_length)
SELFDRAFT_M = METHODS["selfdraft"].draft_length


def rows(target, compile: bool) -> dict:
    """name -> (make a decoder, what it is); a decoder has generate(prompt, request) -> GenerationResult."""
    staged, two = StagedTarget(target, 1), StagedTarget(target, 2)
    eagle3 = lambda: Eagle3Module.untrained(staged, "eagle3", 1, seed=0)             # noqa: E731
    spd_module = lambda: SpeculationModule.from_target(two, 1, seed=1)               # noqa: E731
    out = {
        "ar": (lambda: ARDecoder(staged, frozenset()), "the suite's AR, eager loop"),
        "ar_device": (lambda: DeviceChainDecoder(staged, frozenset()), "the suite's AR through the device step"),
        "lookup": (lambda: ChainDecoder(staged, LookupDrafter(), frozenset(), K), "the lookup's chain today"),
        "lookup_device": (lambda: DeviceChainDecoder(staged, frozenset(), LookupDrafter(), K),
                          "the lookup's chain through the device step"),
        "suffix": (lambda: ChainDecoder(staged, SuffixDrafter(), frozenset(), 15),
                   "the priced context statistics' chain today"),
        "suffix_device": (lambda: DeviceChainDecoder(staged, frozenset(), SuffixDrafter(), 15),
                          "the priced context statistics' chain through the device step"),
        "suffix_tree": (lambda: ChainDecoder(staged, SuffixDrafter(), frozenset(), 15, 4, 16),
                        "the default's trees today (context statistics, W = 4, 16 nodes)"),
        "suffix_tree_device": (lambda: DeviceChainDecoder(staged, frozenset(), SuffixDrafter(), 15, width=4, budget=16),
                               "the default's trees through the device step"),
        "eagle3": (lambda: ChainDecoder(staged, Eagle3Drafter(eagle3(), staged.embed), frozenset(), 5),
                   "EAGLE-3's chain today (an untrained module)"),
        "eagle3_device": (lambda: DeviceChainDecoder(staged, frozenset(), None, 5,
                                                     device_drafter=Eagle3DeviceDrafter(eagle3(), staged.embed)),
                          "EAGLE-3's chain drafted inside the device step (the same module)"),
        "eagle3_tree": (lambda: ChainDecoder(staged, Eagle3Drafter(eagle3(), staged.embed), frozenset(), 5, 4, 16),
                        "EAGLE-3's dynamic trees today (W = 4, 16 nodes)"),
        "eagle3_tree_device": (lambda: DeviceChainDecoder(staged, frozenset(), None, 5, width=4, budget=16,
                                                          device_drafter=Eagle3DeviceDrafter(eagle3(), staged.embed)),
                               "EAGLE-3's dynamic trees drafted inside the device step"),
        "selfdraft": (lambda: ChainDecoder(staged, SelfDraftDrafter(), frozenset(), SELFDRAFT_M),
                      "Self-Draft today (N = L = 6 branch rows beside its trees, the context cache alone)"),
        "selfdraft_device": (lambda: DeviceChainDecoder(staged, frozenset(), SelfDraftDrafter(), SELFDRAFT_M),
                             "Self-Draft through the device step (its branch rows fixed rows of every step)"),
        "spd_n2": (lambda: PipelineDecoder(two, ModuleDrafter(spd_module()), frozenset()),
                   "SPD's pipeline today, n = 2, one process (an untrained module)"),
        "spd_n2_device": (lambda: DevicePipelineDecoder(two, spd_module(), frozenset()),
                          "SPD's pipeline step on the device, n = 2 (the same module)"),
    }
    if compile:
        out["ar_device_compiled"] = (lambda: DeviceChainDecoder(staged, frozenset(), compile="inductor"),
                                     "the suite's AR through the device step, torch.compile (inductor)")
        out["lookup_device_compiled"] = (lambda: DeviceChainDecoder(staged, frozenset(), LookupDrafter(), K,
                                                                    compile="inductor"),
                                         "the lookup's chain through the device step, torch.compile (inductor)")
        out["suffix_device_compiled"] = (lambda: DeviceChainDecoder(staged, frozenset(), SuffixDrafter(), 15,
                                                                    compile="inductor"),
                                         "the priced context statistics' chain through the device step, compiled")
        out["suffix_tree_device_compiled"] = (lambda: DeviceChainDecoder(staged, frozenset(), SuffixDrafter(), 15,
                                                                         compile="inductor", width=4, budget=16),
                                              "the default's trees through the device step, compiled")
        out["eagle3_device_compiled"] = (lambda: DeviceChainDecoder(staged, frozenset(), None, 5, compile="inductor",
                                                                    device_drafter=Eagle3DeviceDrafter(
                                                                        eagle3(), staged.embed)),
                                         "EAGLE-3's chain inside the device step, compiled")
        out["eagle3_tree_device_compiled"] = (lambda: DeviceChainDecoder(
            staged, frozenset(), None, 5, compile="inductor", width=4, budget=16,
            device_drafter=Eagle3DeviceDrafter(eagle3(), staged.embed)), "EAGLE-3's trees inside the step, compiled")
        out["selfdraft_device_compiled"] = (lambda: DeviceChainDecoder(staged, frozenset(), SelfDraftDrafter(),
                                                                       SELFDRAFT_M, compile="inductor"),
                                            "Self-Draft through the device step, compiled")
        out["spd_n2_device_compiled"] = (lambda: DevicePipelineDecoder(two, spd_module(), frozenset(),
                                                                       compile="inductor"),
                                         "SPD's pipeline step on the device, n = 2, compiled")
    return out


class HFGenerate:
    """transformers' own generate, greedy, with its products (F.linear) and the cache it is given."""

    def __init__(self, model, cache: str | None):
        self.model, self.cache, self.stats = model, cache, None

    def generate(self, prompt, request):
        ids = torch.tensor([prompt])
        extra = {"cache_implementation": self.cache} if self.cache else {}
        start = time.perf_counter()
        with plain_products(self.model), torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=request.max_new_tokens, min_new_tokens=request.max_new_tokens,
                                      do_sample=False, pad_token_id=0, **extra)
        from spd.decoding import GenerationResult
        return GenerationResult(out[0, len(prompt):].tolist(), time.perf_counter() - start, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--compile", action="store_true", help="also the device step through torch.compile")
    parser.add_argument("--rows", default="", help="comma-separated rows to run (default: all; transformers' static "
                        "row always runs, the reference)")
    parser.add_argument("--out", default="docs/results/overhead.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    target = tiny_model("llama", num_layers=2, hidden_size=64, head_dim=16, vocab_size=256, tied=False,
                        max_position_embeddings=4096)
    g = torch.Generator().manual_seed(0)
    # a prompt that repeats itself: the context drafters find matches, as they do in real answers
    prompts = [(torch.randint(1, 250, (24,), generator=g).tolist() * 3) for _ in range(args.prompts)]
    params = SamplingParams(temperature=args.temperature)
    makers = {"hf_dynamic": (lambda: HFGenerate(target, None), "transformers generate, dynamic cache"),
              "hf_static": (lambda: HFGenerate(target, "static"), "transformers generate, static cache"),
              **rows(target, args.compile)}
    if args.rows:
        wanted = set(args.rows.split(",")) | {"hf_static"}
        unknown = wanted - set(makers)
        if unknown:
            raise SystemExit(f"--rows: no row {', '.join(sorted(unknown))}; rows: {', '.join(makers)}")
        makers = {name: m for name, m in makers.items() if name in wanted}
    if not params.greedy:     # transformers' sampling draws other tokens: its rows time greedy decoding only
        makers = {name: m for name, m in makers.items() if not name.startswith("hf_")}
    decoders = {name: make() for name, (make, _) in makers.items()}
    for decoder in decoders.values():          # warm: allocation, kernels, compilation
        decoder.generate(prompts[0], Request(args.tokens, params, 0))
    times = {name: [] for name in decoders}
    taus = {name: [] for name in decoders}
    for _ in range(args.repeats):
        for i, p in enumerate(prompts):
            for name, decoder in decoders.items():          # the rows take turns: drift hits all of them
                first = decoder.generate(p, Request(1, params, i))
                result = decoder.generate(p, Request(args.tokens, params, i))
                times[name].append((result.seconds - first.seconds) / (len(result.token_ids) - 1))
                stats = result.stats
                tau = getattr(stats, "tau", None) or (stats.eal / stats.n if getattr(stats, "eal", None) else None)
                taus[name].append(tau if tau is not None else 1.0)
    table = {}
    for name, (_, what) in makers.items():
        per_token = statistics.median(times[name])
        tau = statistics.fmean(taus[name])
        table[name] = {"what": what, "us_per_token": per_token * 1e6, "tau": tau,
                       "us_per_cycle": per_token * tau * 1e6,
                       "vs_hf_static": per_token / statistics.median(times["hf_static"]) if "hf_static" in times
                       else None}
    for name, row in table.items():        # each device row against its method's loop today
        base = name.split("_device")[0]
        if "_device" in name and base in table:
            row["vs_today"] = row["us_per_token"] / table[base]["us_per_token"]
    print(f"{'row':24} {'µs/token':>9} {'tau':>5} {'µs/cycle':>9}  what")
    for name, row in table.items():
        print(f"{name:24} {row['us_per_token']:9.1f} {row['tau']:5.2f} {row['us_per_cycle']:9.1f}  {row['what']}")
    write_json(args.out, {"target": "tiny random Llama, 2 layers, d = 64, V = 256, float32", "tokens": args.tokens,
                          "prompts": args.prompts, "repeats": args.repeats, "temperature": args.temperature,
                          "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": table})


if __name__ == "__main__":
    main()
