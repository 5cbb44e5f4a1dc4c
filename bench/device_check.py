"""Lossless check on a given device and dtype: greedy SPD (a random module, so rollbacks everywhere) must equal the
project's plain AR decoding token for token; sampled SPD must run. The CPU path is covered by the test suite;
this script is for CUDA machines.

    python -m bench.device_check --device cuda [--dtype float32|bfloat16] [--target smollm2] [--limit 4]
Writes docs/results/device_check_<device>_<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from spd.decoding import Request, eos_ids_of
from spd.drafters.spd_module import ModuleDrafter
from spd.engine import build_decoder
from spd.methods import AR, PIPELINE
from spd.models.module import SpeculationModule
from spd.corpora.prompts import DATASETS, chat_prompt_ids, load_questions
from spd.verify.sampling import SamplingParams
from spd.targets.loaded import DTYPES
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--limit", type=int, default=4, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ns", default="3,5,10")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    loaded = load_target(args.target, DTYPES[args.dtype], args.device)
    eos = eos_ids_of(loaded.model.config, loaded.tokenizer)
    greedy, sampled = SamplingParams(), SamplingParams(temperature=1.0, top_k=50)
    prompts = [chat_prompt_ids(loaded.tokenizer, q["turns"][0]) for ds in DATASETS for q in load_questions(ds)[: args.limit]]
    rows = []
    for n in [int(x) for x in args.ns.split(",")]:
        staged = StagedTarget(loaded.model, n)
        module = SpeculationModule.from_target(staged, 1, seed=0).to(DTYPES[args.dtype]).eval()
        for i, ids in enumerate(prompts):
            ar = build_decoder(AR, staged, eos).generate(ids, Request(args.max_new_tokens, greedy))
            spd = build_decoder(PIPELINE, staged, eos, ModuleDrafter(module)).generate(ids, Request(args.max_new_tokens,
                                                                                             greedy))
            t1 = build_decoder(PIPELINE, staged, eos, ModuleDrafter(module)).generate(ids, Request(args.max_new_tokens,
                                                                                            sampled, seed=i))
            rows.append({"n": n, "prompt": i, "identical": spd.token_ids == ar.token_ids, "N": len(spd.token_ids),
                         "K": spd.stats.K, "rollbacks": spd.stats.rollbacks, "sampled_N": len(t1.token_ids),
                         "ar_tokens_per_s": ar.tokens_per_s, "spd_tokens_per_s": spd.tokens_per_s})
            print(json.dumps(rows[-1]), flush=True)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()
    result = {"device": args.device, "device_name": device_name, "dtype": args.dtype, "torch": torch.__version__,
              "target": loaded.name, "max_new_tokens": args.max_new_tokens, "prompts": len(prompts),
              "identical": sum(r["identical"] for r in rows), "runs": len(rows), "rows": rows,
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = args.out or f"docs/results/device_check_{args.device.split(':')[0]}_{args.dtype}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(out + ".tmp", out)
    print(f"{result['identical']}/{result['runs']} greedy SPD runs identical to AR on {device_name} ({args.dtype})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
