"""Why the SPD authors' W > 1 verification is not lossless, computed exactly (design §8).

At one tree node the target's p and the drafter's q are fixed; the node's children are q's top-W tokens (what the
authors' code drafts). Their rule tests each child with its own coin, u * q(x) <= p(x), keeps the first that
passes, and draws from norm(max(p - q, 0)) when none does. The suite's rule (spd.verify.sampling.settle_children) draws
x ~ p once and descends into x if it is a child, so what it emits is p by construction (tests/test_tree_sampling.py
checks the code with a chi-square test). This script computes the authors' rule's output distribution exactly (no
sampling) on the toy p, q of that test and on SmolLM2-sized random ones, and writes its total variation from p.

    python -m experiments.tree_rule --out docs/results/tree_rule.json

The figure's page: docs/lossless.md, "The draft-tree verification rule, and why the authors' rule is not lossless".
"""

from __future__ import annotations

import argparse
import sys

import torch

from spd.eval.output import write_json


def authors_rule(p: torch.Tensor, q: torch.Tensor, width: int) -> torch.Tensor:
    """The emitted token's exact distribution under one coin per copy (children = q's top-W)."""
    out = torch.zeros_like(p)
    none = 1.0                                   # probability that every copy so far rejected
    for x in torch.topk(q, width).indices.tolist():
        keep = min(1.0, float(p[x] / q[x]))
        out[x] += none * keep
        none *= 1 - keep
    residual = (p - q).clamp(min=0)
    return out + none * residual / residual.sum()


def row(name: str, p: torch.Tensor, q: torch.Tensor, width: int) -> dict:
    authors = authors_rule(p, q, width)
    top = int(torch.argmax(q))
    return {"case": name, "W": width, "vocab": p.numel(), "tv_authors": 0.5 * float((authors - p).abs().sum()),
            "q_top_token": top, "p_of_q_top": float(p[top]), "authors_emit_q_top": float(authors[top])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/tree_rule.json")
    args = ap.parse_args()
    torch.set_default_dtype(torch.float64)
    toy_p = torch.softmax(torch.tensor([1.2, 0.9, 0.1, -0.3, 0.6, -1.0]), -1)
    toy_q = torch.softmax(torch.tensor([0.4, 1.3, 0.8, -0.5, 0.2, 0.0]), -1)
    rows = [row("toy (tests/test_tree_sampling.py)", toy_p, toy_q, w) for w in (2, 4)]
    g = torch.Generator().manual_seed(0)
    for w in (2, 4):
        tvs = []
        for _ in range(200):    # a 49,152-token vocabulary, q a noisy copy of p (a drafter that is often right)
            logits = torch.randn(49152, generator=g) * 3
            p = torch.softmax(logits, -1)
            q = torch.softmax(logits + torch.randn(49152, generator=g), -1)
            tvs.append(row("", p, q, w))
        rows.append({"case": "SmolLM2-sized random p, q = p with logit noise (mean of 200)", "W": w,
                     "vocab": 49152, **{k: sum(r[k] for r in tvs) / len(tvs)
                                        for k in ("tv_authors", "p_of_q_top", "authors_emit_q_top")}})
    write_json(args.out, {"rows": rows, "command": " ".join(["python", *sys.argv])})
    print("| case | W | TV(authors' rule, p) | p(q's top token) | authors' rule emits it |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['W']} | {r['tv_authors']:.4f} | {r['p_of_q_top']:.3f} | "
              f"{r['authors_emit_q_top']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
