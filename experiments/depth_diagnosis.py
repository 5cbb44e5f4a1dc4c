"""Does the module read its deep rows? Per-occupancy acceptance of one or more modules on fixed greedy traces.

On the target's own greedy traces of the eval prompts (first --limit of each set, --max-new-tokens each), for every
occupancy a = 1..n, the fraction of positions where the module's draft equals the target's next greedy token (the
per-draft acceptance greedy decoding sees at that occupancy), and the same with
  - the depth-n rows shuffled along the sequence (same rows, wrong positions),
  - the depth-n rows zeroed,
  - no memory at all (the query row alone: the module as a function of the current token),
beside a count-based bigram predictor fitted on the training conversations (the best any function of the
current token alone can do on this data). Also: how much of the state the head reads is still the query row; the scale of every hidden state a feature reads (RMS, share of the
squared norm in its 3 largest dimensions), each input's share of g^k = FC_k(...), and per-FC gradient norms of the
greedy cross-entropy on the traces. Greedy L'acc from the exact fast evaluator goes beside each module.

    python -m experiments.depth_diagnosis --checkpoint base=outputs/diag/e0/checkpoint --checkpoint std=... \
        --out docs/results/depth_diagnosis.json

The figure's page: docs/training.md, "The recipe, and why each option is there".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter, defaultdict

import torch
import torch.nn.functional as F

from spd.models.attention import memory_kv, rotate
from spd.eval.output import write_json
from spd.models.checkpoint import load_checkpoint, read_checkpoint_config
from spd.eval.fast import GreedyTrace
from spd.eval.fast_trace import fast_greedy_stats
from spd.layout import needed_layers
from spd.metrics import pooled_eal
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget
from spd.train.data import load_conversations, tokenize_conversations

from bench.acceptance import load_traces


def drafted_positions(trace: GreedyTrace) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions t whose draft decoding can use (t >= P: the first generated token came from prefill) and the
    target's token at t + 1."""
    p, seq = len(trace.prompt_ids), trace.prompt_ids + trace.tokens
    t = torch.arange(p, p + len(trace.tokens) - 1)
    return t, torch.tensor(seq)[t + 1]


@torch.no_grad()
def acceptance_per_occupancy(module, traces: list[GreedyTrace], variant: str, seed: int = 0) -> dict[int, float]:
    n = module.n
    hits, total = torch.zeros(n), 0
    g = torch.Generator().manual_seed(seed)
    for trace in traces:
        feats = module.features(trace.hidden)
        width = feats[0].shape[1]
        valid = torch.ones(n, width, dtype=torch.bool)
        if variant == "deep_shuffled":
            feats[n] = feats[n][:, torch.randperm(width, generator=g)]
        elif variant == "deep_zeroed":
            feats[n] = torch.zeros_like(feats[n])
        elif variant == "no_memory":
            valid[:] = False   # every key but the query's own row is masked
        logits = module.forward_layout({k: f.expand(n, -1, -1) for k, f in feats.items()}, torch.arange(1, n + 1), valid)
        drafts = logits.argmax(-1)
        if module.draft_to_target is not None:
            drafts = module.draft_to_target[drafts]
        t, want = drafted_positions(trace)
        hits += (drafts[:, t] == want).float().sum(-1)
        total += len(t)
    return {a + 1: float(hits[a] / total) for a in range(n)}


def bigram_accuracy(examples: list[dict], traces: list[GreedyTrace]) -> dict:
    following: dict[int, Counter] = defaultdict(Counter)
    overall: Counter = Counter()
    for ex in examples:
        ids, mask = ex["input_ids"], ex["loss_mask"]
        for t in range(len(ids) - 1):
            if mask[t]:
                following[ids[t]][ids[t + 1]] += 1
                overall[ids[t + 1]] += 1
    fallback = overall.most_common(1)[0][0]
    hits = total = 0
    for trace in traces:
        seq = trace.prompt_ids + trace.tokens
        t, want = drafted_positions(trace)
        for pos, target in zip(t.tolist(), want.tolist()):
            seen = following.get(seq[pos])
            hits += (seen.most_common(1)[0][0] if seen else fallback) == target
            total += 1
    return {"accuracy": hits / total, "positions": total, "contexts": len(following)}


@torch.no_grad()
def input_scales(traces: list[GreedyTrace], layers: list[int]) -> dict[int, dict]:
    out = {}
    for layer in layers:
        h = torch.cat([tr.hidden[layer][0, 1:] for tr in traces])   # [M, d], BOS left out
        sq = h.pow(2)
        out[layer] = {"rms": float(sq.mean().sqrt()),
                      "top3_share": float((sq.topk(3, -1).values.sum(-1) / sq.sum(-1)).median()),
                      "top3_dims": sq.mean(0).topk(3).indices.tolist()}
    return out


@torch.no_grad()
def fused_input_shares(module, traces: list[GreedyTrace]) -> dict[int, dict]:
    """For each FC_k (k >= 1): RMS of W_k[:, part] @ input_part for the parts H^0, H^{m_k}, H^{b_k}."""
    out = {}
    for k in range(1, module.n + 1):
        weight = module.fc[str(k)].weight.float()
        d = weight.shape[0]
        parts = {}
        for j, layer in enumerate(module.feature_layers[k]):
            x = torch.cat([module.feature_input(layer, tr.hidden[layer][0, 1:]) for tr in traces]).float()
            parts[f"H{layer}"] = float((x @ weight[:, j * d:(j + 1) * d].T).pow(2).mean().sqrt())
        out[k] = parts
    return out


@torch.no_grad()
def query_share(module, traces: list[GreedyTrace]) -> dict[str, float]:
    """How much of the state the head reads (before the final norm) is still the query row g^0 = FC_0(H^0) —
    the only carrier of the current token besides attention — at a = 1: RMS ratio and cosine."""
    ratios, cosines = [], []
    captured = {}
    hook = module.norm.register_forward_hook(lambda mod, args, out: captured.update(h=args[0]))
    try:
        for trace in traces:
            feats = module.features(trace.hidden)
            module.forward_layout(feats, torch.tensor([1]))
            g0, h = feats[0][0].float(), captured["h"][0].float()
            ratios.append(g0.pow(2).mean(-1).sqrt() / h.pow(2).mean(-1).sqrt())
            cosines.append(F.cosine_similarity(g0, h, dim=-1))
    finally:
        hook.remove()
    return {"rms_ratio": float(torch.cat(ratios).median()), "cosine": float(torch.cat(cosines).median())}


@torch.no_grad()
def attention_by_lag(module, traces: list[GreedyTrace], lags: int = 8) -> dict:
    """Where the first module layer's heads look at a = 1: the mean attention probability a query at t puts on
    the memory row t - lag (lag 1 = the previous token, whose full-depth state EAGLE's first draft reads) and on
    its own row, per head, beside the uniform 1 / (t + 1) an attention blind to position would give."""
    layer = module.layers[0]
    attn = layer.self_attn
    hd = attn.head_dim
    by_lag, own, uniform, count = None, None, 0.0, 0
    for trace in traces:
        g0 = module.feature(0, trace.hidden)            # [1, N, d]
        deep = module.feature(module.n, trace.hidden)   # [1, N, d]
        n_pos = g0.shape[1]
        cos, sin = module.rope(torch.arange(n_pos)[None], g0)
        k, _ = memory_kv(layer, deep, cos, sin)         # [1, H_kv, N, hd]
        k_own, _ = memory_kv(layer, g0, cos, sin)
        q = attn.q_proj(layer.input_layernorm(g0)).view(1, n_pos, -1, hd).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
        q = rotate(q, cos, sin)[0]                      # [H, N, hd]
        groups = q.shape[0] // k.shape[1]
        k, k_own = k[0].repeat_interleave(groups, 0), k_own[0].repeat_interleave(groups, 0)
        scores = q @ k.transpose(-1, -2) * attn.scaling                       # [H, N, N]
        scores = scores.masked_fill(~torch.ones(n_pos, n_pos, dtype=torch.bool).tril(-1), float("-inf"))
        probs = torch.cat([scores, (q * k_own).sum(-1, keepdim=True) * attn.scaling], -1).softmax(-1)
        t, _ = drafted_positions(trace)
        lag_mass = torch.stack([probs[:, t, t - j] for j in range(1, lags + 1)], -1)   # [H, T, lags]
        by_lag = lag_mass.sum(1) if by_lag is None else by_lag + lag_mass.sum(1)
        own = probs[:, t, -1].sum(1) if own is None else own + probs[:, t, -1].sum(1)
        uniform += float((1.0 / (t + 1).float()).sum())
        count += len(t)
    return {"per_head_by_lag": (by_lag / count).tolist(), "per_head_own_row": (own / count).tolist(),
            "uniform": uniform / count}


def fc_gradient_norms(module, traces: list[GreedyTrace], occupancy: int) -> dict[str, float]:
    """Per-FC gradient norm of the greedy cross-entropy (target's tokens) over the traces at one occupancy."""
    module.zero_grad()
    n = module.n
    for trace in traces:
        feats = module.features(trace.hidden)
        logits = module.forward_layout(feats, torch.tensor([occupancy]))[0]
        t, want = drafted_positions(trace)
        if module.draft_to_target is not None:
            index = torch.full((module.target_vocab_size,), -100, dtype=torch.long)
            index[module.draft_to_target] = torch.arange(module.draft_to_target.numel())
            want = index[want]
        F.cross_entropy(logits[t].float(), want, ignore_index=-100, reduction="sum").backward()
    norms = {f"fc{k}": float(fc.weight.grad.norm()) for k, fc in module.fc.items()}
    module.zero_grad()
    return norms


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", action="append", required=True, help="label=path (repeatable)")
    ap.add_argument("--limit", type=int, default=10, help="prompts per eval set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--bigram-conversations", type=int, default=4000,
                    help="ShareGPT conversations the bigram predictor counts")
    ap.add_argument("--cache-dir", default="outputs/cache")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    labelled = [spec.split("=", 1) for spec in args.checkpoint]
    torch.set_grad_enabled(True)
    loaded = load_target("smollm2")
    first = read_checkpoint_config(labelled[0][1])
    staged = StagedTarget(loaded.model, first["n"], first["stage_bounds"])
    _, raw = load_traces(loaded, staged, args.limit, args.max_new_tokens, args.cache_dir)
    traces = [GreedyTrace(r["prompt_ids"], r["tokens"], r["hidden"], r["margins"]) for r in raw]
    convs = load_conversations("sharegpt", args.bigram_conversations)
    examples = tokenize_conversations(loaded.tokenizer, convs, 4096, log=lambda m: None)
    result = {"limit": args.limit, "max_new_tokens": args.max_new_tokens, "stage_bounds": staged.bounds,
              "bigram": {**bigram_accuracy(examples, traces), "conversations": len(examples)},
              "input_scales": input_scales(traces, needed_layers(staged.bounds)), "modules": {}}
    print(json.dumps({"bigram": result["bigram"]}))
    for label, path in labelled:
        module = load_checkpoint(path, staged, loaded).eval()
        meta = read_checkpoint_config(path)
        row = {"checkpoint": path, "train_tokens": meta.get("train_tokens"), "training": meta.get("training"),
               "eal": pooled_eal([fast_greedy_stats(module, tr)["stats"] for tr in traces])}
        for variant in ("as_trained", "deep_shuffled", "deep_zeroed", "no_memory"):
            row[variant] = acceptance_per_occupancy(module, traces, variant)
        row["fused_input_rms"] = fused_input_shares(module, traces)
        row["query_share_a1"] = query_share(module, traces)
        row["fc_grad_norm_a1"] = fc_gradient_norms(module, traces, 1)
        row["attention_by_lag_a1"] = attention_by_lag(module, traces)
        result["modules"][label] = row
        print(json.dumps({label: {k: v for k, v in row.items() if k != "training"}}))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
