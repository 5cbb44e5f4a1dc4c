"""Where T = 1 drafts could come from on this machine: sampled answers (the suite's AR, top-k 50, top-p 1, one seed per
prompt, as bench/clock.py samples) of the everyday and eval sets, and for every answer position the target's own
sampling distribution p. Two measures over them:

- how much of p a candidate set covers at depth 1 (a node advances with the sum of p over its deterministic
  children, spd.verify.sampling.settle_children): the target's own top-k (a ceiling no drafter without a forward reaches),
  and the top-k the target produced the last time it read the same token (Token Recycling's adjacency: the
  target's recycled rows);
- the priced replay of each drafter over the sampled answers (spd.eval.fast_chain.replay with the sampled token as
  the one draw at each node, which is how verification settles deterministic children; the machine's row costs,
  spd.targets.row_costs): the lookup chain, the default's priced context statistics (method=suffix W = 4), and
  those statistics with recycled children added (a drafter that lives only here, told the top ids of every row
  the target verified — prompt and accepted path — as the runtime could tell it); the default also priced by the
  noise of the keyed draws (spd.verify.sampling.KeyedDraws), drawn from their posterior given the answer's tokens.

    python -m experiments.t1_sources --out docs/results/t1_sources.json

The figure's page: docs/speed-cpu.md, "How good the pricing is".
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch
from tqdm import tqdm

from spd.decoding import Request, eos_ids_of
from spd.models.checkpoint import load_checkpoint
from spd.drafters.eagle3 import Eagle3Drafter
from spd.drafters.lookup import LookupDrafter
from spd.drafters.suffix import Retrieval, SuffixDrafter, _Node
from spd.drafters.suffix_eagle3 import SuffixEagle3Drafter
from spd.engine import build_decoder
from spd.eval.output import write_json
from spd.eval.fast_chain import replay
from spd.methods import AR
from spd.pricing import Evidence
from spd.corpora.retrieval import open_datastore
from spd.verify.sampling import SamplingParams
from spd.targets.loading import load_target
from spd.targets.row_costs import cached_row_costs
from spd.targets.stages import StagedTarget
from bench.prompt_sets import prompt_set

TOP = 16             # ids and probabilities kept per row


class RecyclingSuffix(SuffixDrafter):
    """The priced context statistics plus recycled children: below the root (and below each recycled child, to
    depth 3) the top ids of the target's row the last time it read that token, each with its probability there as
    its share. rows: the answer's per-row top ids and probabilities (prompt rows first)."""

    def __init__(self, rows: dict, costs, only: bool = False, k: tuple[int, int] = (8, 2)):
        super().__init__(1, 8, costs)
        self.rows, self.only, self.k, self.adjacency = rows, only, k, {}

    def _read(self, first: int, last: int, tokens: list[int]) -> None:
        for j in range(first, last + 1):      # row j read tokens[j]; its logits chose tokens[j + 1]
            self.adjacency[tokens[j]] = (self.rows["ids"][j], self.rows["p"][j])

    def start(self, prompt_hidden, tokens) -> None:
        super().start(prompt_hidden, tokens)
        self.adjacency = {}
        self._read(0, len(tokens) - 2, tokens)

    def observe(self, hidden, tokens) -> None:
        before = len(self.index)
        super().observe(hidden, tokens)
        self._read(before - 1, len(tokens) - 2, tokens)

    def candidates(self, m: int, width: int, budget: int):
        nodes, evidence = ([], []) if self.only else super().candidates(m, width, budget)
        taken = {node.token for node in nodes if node.parent == -1}

        def below(parent: int, token: int, depth: int) -> None:
            if token not in self.adjacency or depth > 3:
                return
            ids, ps = self.adjacency[token]
            for child, p in list(zip(ids, ps))[: self.k[depth > 1]]:
                if depth == 1 and child in taken:
                    continue
                nodes.append(_Node(child, parent, depth, p))
                evidence.append(Evidence("recycle", 9, p, 1.0, depth, self.margin))
                below(len(nodes) - 1, child, depth + 1)
        below(-1, self.index.tokens[-1], 1)
        return nodes, evidence


class PosteriorNoise:
    """Keyed draws as they would have been for a sampled answer: at each answer position, uniforms drawn from the
    Gumbel-max posterior given that the answer's token won (the winning score M ~ Gumbel(0) — p is normalised — and
    every other token's score a Gumbel at log p truncated below M), so the replay's drafter sees noise distributed
    exactly as the runtime's, consistent with the tokens the answer holds. Tokens outside the record's top 16 are
    taken to have p = 0 (their uniforms free), a token that won from there p = the rest's mass / 34."""

    def __init__(self, record: dict, seed: int):
        self.rng = random.Random(seed)
        self.at: dict[int, dict[int, float]] = {}
        self.drawn: dict[int, float] = {}     # the target's p of the answer's token, as KeyedDraws records it
        prompt_len = len(record["prompt"])
        for a, won in enumerate(record["answer"]):
            ids, ps = record["ids"][prompt_len + a - 1], record["p"][prompt_len + a - 1]
            top = self.rng.random()     # e^(-e^(-M)) for M ~ Gumbel(0): uniform
            # u of a token of probability q is e^(-q e^(-M)) = top ** q if it won, uniform below that if not
            rest = max(1.0 - sum(ps), 1e-9)
            noise = {token: self.rng.random() * top ** q for token, q in zip(ids, ps) if token != won}
            chance = dict(zip(ids, ps)).get(won, rest / (50 - TOP))
            noise[won] = top ** chance
            self.at[prompt_len + a] = noise
            self.drawn[prompt_len + a] = chance

    def chance(self, position: int) -> float:
        return self.drawn.get(position, float("nan"))

    def uniform(self, position: int, token: int) -> float:
        noise = self.at.setdefault(position, {})
        if token not in noise:
            noise[token] = self.rng.random()
        return noise[token]


def sample(loaded, prompts, max_new: int) -> list[dict]:
    """Each prompt's sampled answer (seed = its index) and every row's top ids, sampling probabilities and margin."""
    staged = StagedTarget(loaded.model, 1)
    decoder = build_decoder(AR, staged, eos_ids_of(loaded.model.config, loaded.tokenizer))
    params = SamplingParams(temperature=1.0, top_k=50, top_p=1.0)
    out = []
    for i, (key, ids) in enumerate(tqdm(prompts, desc="sampling", unit="prompt")):
        answer = decoder.generate(ids, Request(max_new, params, seed=i)).token_ids
        with torch.no_grad():
            logits = loaded.model(torch.tensor([ids + answer])).logits[0].float()      # [P + A, V]
        top = torch.topk(logits, 50, dim=-1)
        p = torch.softmax(top.values, dim=-1)                                        # the top-k 50 distribution
        out.append({"key": key, "prompt": ids, "answer": answer, "ids": top.indices[:, :TOP].tolist(),
                    "p": p[:, :TOP].tolist(), "margin": (top.values[:, 0] - top.values[:, 1]).tolist()})
    return out


def coverage(records: list[dict], ks=(1, 2, 4, 8, 16)) -> dict:
    """Mean over answer positions of the p mass in the target's own top-k and in its recycled top-k."""
    own, recycled, n = dict.fromkeys(ks, 0.0), dict.fromkeys(ks, 0.0), 0
    for r in records:
        seq, prompt_len = r["prompt"] + r["answer"], len(r["prompt"])
        last = {seq[j]: j for j in range(prompt_len - 1)}
        for row in range(prompt_len - 1, len(seq) - 1):
            p_of = dict(zip(r["ids"][row], r["p"][row]))
            earlier = last.get(seq[row])
            for k in ks:
                own[k] += sum(r["p"][row][:k])
                if earlier is not None:
                    recycled[k] += sum(p_of.get(t, 0.0) for t in r["ids"][earlier][:k])
            last[seq[row]] = row
            n += 1
    return {"positions": n, "own_top_k": {k: v / n for k, v in own.items()},
            "recycled_top_k": {k: v / n for k, v in recycled.items()}}


def priced_replays(records: list[dict], costs, eagle3=None, retrieval=None) -> list[dict]:
    """Each drafter replayed over the sampled answers: tau, rows a cycle, and the speedup the row costs predict —
    before the drafter's own time, and with it (the replay's seconds, which are the drafter's work: its passes, its
    statistics, the replay's walk). eagle3: (staged target, module) adds EAGLE-3's children beside the statistics;
    retrieval (spd.drafters.suffix.Retrieval): the default with a datastore's candidates too."""
    drafters = {"lookup chain m = 7": (lambda r: LookupDrafter(2, 8), 7, 1, 7),
                "suffix W = 4 (the default)": (lambda r: SuffixDrafter(1, 8, costs), 15, 4, 16),
                "suffix W = 4 + recycled (8 at depth 1, 2 below)": (lambda r: RecyclingSuffix(r, costs), 15, 4, 16),
                "recycled only": (lambda r: RecyclingSuffix(r, costs, only=True), 15, 4, 16)}
    if retrieval is not None:
        drafters["suffix W = 4 + datastore"] = (lambda r: SuffixDrafter(1, 8, costs, retrieval=retrieval), 15, 4, 16)
    # the same drafters told the keyed draws (each position's noise, PosteriorNoise): priced by the noise
    keyed = {f"{name}, priced by the noise": drafters[name] for name in
             ("suffix W = 4 (the default)", "suffix W = 4 + datastore") if name in drafters}
    drafters.update(keyed)
    states = {}
    if eagle3 is not None:
        staged, module = eagle3
        for width, depth, gate in ((4, 1, 1.0), (4, 2, 1.0), (2, 1, 1.0), (4, 1, 0.6), (4, 2, 0.6)):
            drafters[f"suffix W = 4 + EAGLE-3 (width {width}, depth {depth}, gate {gate})"] = (
                lambda r, w=width, d=depth, g=gate: SuffixEagle3Drafter(Eagle3Drafter(module, staged.embed), costs, 8, w, d,
                                                                         g), 15, 4, 16)
        for r in tqdm(records, desc="target states", unit="answer"):
            ids = torch.tensor([r["prompt"] + r["answer"]])
            with torch.no_grad():
                states[id(r)] = staged.forward_all(ids, None, capture=frozenset(module.layers_needed()))[1]
    rows = []
    for name, (make, m, width, budget) in drafters.items():
        tokens = seconds = cycles = fed = spent = 0
        for i, r in enumerate(records):
            prompt_len = len(r["prompt"])
            margins = r["margin"][prompt_len - 1: prompt_len - 1 + len(r["answer"])]
            draws = PosteriorNoise(r, seed=i) if name in keyed else None
            drafter, began = make(r), time.perf_counter()
            got = replay(drafter, r["prompt"], r["answer"], m, width, budget, hidden=states.get(id(r)),
                         margins=margins, draws=draws)["rows_per_cycle"]
            spent += time.perf_counter() - began
            tokens, cycles, fed = tokens + len(r["answer"]), cycles + len(got), fed + sum(got)
            seconds += sum(costs.seconds[min(x, costs.max_rows) - 1] for x in got)
        rows.append({"drafter": name, "tau": tokens / cycles, "rows_per_cycle": fed / cycles,
                     "predicted_speedup": tokens * costs.seconds[0] / seconds,
                     "drafter_seconds_per_cycle": spent / cycles,
                     "predicted_speedup_with_drafter": tokens * costs.seconds[0] / (seconds + spent)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=10, help="eval prompts per data set")
    ap.add_argument("--everyday-limit", type=int, default=30)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--cache", default="outputs/cache/t1_sources.pt", help="the sampled answers, reused when present")
    ap.add_argument("--eagle3", default=None, help="an EAGLE-3 checkpoint: also its children beside the statistics")
    ap.add_argument("--sets", default="everyday,eval")
    ap.add_argument("--datastore", default=None, help="e.g. sharegpt: also the default with this datastore")
    ap.add_argument("--out", default="docs/results/t1_sources.json")
    args = ap.parse_args()
    loaded = load_target()
    sets = {name: prompt_set(name, args, loaded.tokenizer) for name in ("everyday", "eval")}
    key = (args.limit, args.everyday_limit, args.max_new_tokens)
    cached = torch.load(args.cache) if os.path.isfile(args.cache) else None
    if cached is None or cached["key"] != key:
        cached = {"key": key, "sets": {name: sample(loaded, prompts, args.max_new_tokens)
                                       for name, prompts in sets.items()}}
        os.makedirs(os.path.dirname(args.cache) or ".", exist_ok=True)
        torch.save(cached, args.cache + ".tmp")
        os.replace(args.cache + ".tmp", args.cache)
    staged = StagedTarget(loaded.model, 1)
    costs = cached_row_costs(staged, 17)
    result = {"command": " ".join(["python", *sys.argv]), "row_costs_s": list(costs.seconds), "sets": {}}
    eagle3 = retrieval = None
    if args.datastore:
        retrieval = Retrieval(open_datastore(args.datastore, loaded.tokenizer, loaded.model.config.vocab_size))
        result["datastore"] = args.datastore
    if args.eagle3:
        eagle3 = (staged, load_checkpoint(args.eagle3, staged, loaded).eval())
        result["eagle3"] = args.eagle3
    for name, records in cached["sets"].items():
        if name not in args.sets.split(","):
            continue
        result["sets"][name] = {"prompts": len(records), **coverage(records),
                                "replays": priced_replays(records, costs, eagle3, retrieval)}
        print(name, {k: round(v, 3) for k, v in result["sets"][name]["own_top_k"].items()},
              {k: round(v, 3) for k, v in result["sets"][name]["recycled_top_k"].items()})
        for row in result["sets"][name]["replays"]:
            print(f"  {row['drafter']:60s} tau {row['tau']:.3f} rows {row['rows_per_cycle']:.2f} "
                  f"predicted {row['predicted_speedup']:.3f}x, with the drafter's time "
                  f"{row['predicted_speedup_with_drafter']:.3f}x ({1000 * row['drafter_seconds_per_cycle']:.1f} ms)")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
