"""Greedy SPD vs Hugging Face `generate(do_sample=False)` on the 240 eval prompts (first turn, chat template).

SPD must equal HF token for token wherever HF's top-2 logit margin exceeds 1e-4 (below that, float32 rounding
differences between the two code paths may legitimately flip the argmax). Every divergence is listed with
its margin. The drafter proposes HF's own tokens — drafts never change a lossless decoder's output, they
only make the run faster — so any divergence is the target pipeline's own verdict.

    python -m bench.hf_parity [--n 5] [--max-new-tokens 128] [--limit 80] [--out docs/results/hf_parity.json]
Resumable: finished prompts are kept in <out>.jsonl and skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from tqdm import tqdm

from spd.decoding import Request, eos_ids_of
from spd.drafters.reference import ReferenceDrafter
from spd.engine import build_decoder
from spd.methods import PIPELINE
from spd.corpora.prompts import DATASETS, chat_prompt_ids, load_questions
from spd.verify.sampling import SamplingParams
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget

MARGIN = 1e-4


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=80, help="prompts per dataset")
    ap.add_argument("--out", default="docs/results/hf_parity.json")
    args = ap.parse_args()
    loaded = load_target("smollm2")
    model, tok = loaded.model, loaded.tokenizer
    staged = StagedTarget(model, args.n)
    eos = eos_ids_of(model.config, tok)
    rows_path = args.out + "l"
    done = {}
    if os.path.exists(rows_path):
        with open(rows_path) as f:
            for line in f:
                row = json.loads(line)
                done[(row["dataset"], row["question_id"])] = row
    work = [(ds, q) for ds in DATASETS for q in load_questions(ds)[: args.limit]]
    with open(rows_path, "a") as sink:
        for ds, q in tqdm(work, desc="hf parity"):
            if (ds, q["question_id"]) in done:
                continue
            ids = chat_prompt_ids(tok, q["turns"][0])
            with torch.no_grad():
                hf = model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
            hf_tokens = hf.sequences[0, len(ids):].tolist()
            margins = [float(torch.topk(step[0].float(), 2).values.diff().abs()) for step in hf.logits]
            drafter = ReferenceDrafter(ids + hf_tokens + [0] * (args.n + 1), model.config.vocab_size)
            spd = build_decoder(PIPELINE, staged, eos, drafter).generate(ids, Request(args.max_new_tokens, SamplingParams()))
            first = next((i for i, (a, b) in enumerate(zip(spd.token_ids, hf_tokens)) if a != b), None)
            if first is None and len(spd.token_ids) != len(hf_tokens):
                first = min(len(spd.token_ids), len(hf_tokens))
            row = {"dataset": ds, "question_id": q["question_id"], "n_tokens": len(hf_tokens),
                   "equal": first is None, "first_divergence": first,
                   "hf_margin_at_divergence": margins[first] if first is not None and first < len(margins) else None,
                   "K": spd.stats.K}
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            done[(ds, q["question_id"])] = row
    rows = [done[(ds, q["question_id"])] for ds, q in work]
    diverged = [r for r in rows if not r["equal"]]
    unexplained = [r for r in diverged if r["hf_margin_at_divergence"] is None or r["hf_margin_at_divergence"] > MARGIN]
    summary = {"target": loaded.name, "n": args.n, "max_new_tokens": args.max_new_tokens, "prompts": len(rows),
               "identical": len(rows) - len(diverged), "diverged": diverged, "unexplained_divergences": len(unexplained),
               "margin_threshold": MARGIN}
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, args.out)
    print(json.dumps({k: v for k, v in summary.items() if k != "diverged"}, indent=2))
    for r in diverged:
        print(f"  {r['dataset']}/{r['question_id']}: first divergence at token {r['first_divergence']}, "
              f"HF top-2 margin {r['hf_margin_at_divergence']}")
    return 0 if not unexplained else 1


if __name__ == "__main__":
    sys.exit(main())
