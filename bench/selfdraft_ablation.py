"""Self-Draft's ablation on this CPU (Gao et al., AAAI 2025, its N × L table): tokens per target forward (τ) of
`method=selfdraft` at every N (draft branches) and L (branch length) in --grid with the branches' n-grams alone
(verified_ngrams=false) and the corpus n-grams; at N = L = 6 the method's default (the verified text's n-grams too),
each without the corpus; greedy, and sampled (T = 1, top-k 50, keyed draws: the suite's sampled setting) at that cell.

τ counts tokens after the prefill's over target forwards (spd.metrics.ChainStats.tau); it is deterministic, so a busy
machine moves the seconds beside it (kept, not compared) and never τ. Prompts: the first --limit HumanEval and
MT-Bench prompts (first turn, chat template) × --max-new-tokens, stopping at EOS. Every greedy cell is checked token
for token against the suite's AR and the sampled cell against AR's keyed samples; the lookup chain (m = 7, the
method's default) decodes beside them for reference. Each (cell, prompt) is appended to X.jsonl as it finishes and a
run started again skips what is there; X.json holds the table.

    python -m bench.selfdraft_ablation --out docs/results/selfdraft_ablation.json

The figure's page: docs/rivals.md, "Self-Draft".
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
import zlib

import torch
from tqdm import tqdm

from bench.turns import params_for, seed_of
from spd.decoding import Request, eos_ids_of
from spd.drafters.lookup import LookupDrafter
from spd.drafters.selfdraft import SelfDraftDrafter, corpus_ngrams
from spd.engine import build_decoder
from spd.eval.output import write_json
from spd.methods import AR, CHAIN, METHODS
from spd.corpora.prompts import chat_prompt_ids, load_questions
from spd.targets.loading import load_target
from spd.targets.row_costs import _cpu_name
from spd.targets.stages import StagedTarget

SETS = ("humaneval", "mt_bench")
GRAM = 4                         # G, the method's default: a candidate is the G - 1 tokens after the newest one


def cells(grid: list[int], sampled_cell: tuple[int, int]) -> list[dict]:
    """AR first (every later cell is checked against it); the method's default at the sampled cell's N, L (the
    verified text's n-grams in the context cache), without the corpus, and sampled; the lookup chain; the N × L grid
    with the branches' n-grams alone (verified_ngrams=false, the paper's text), its N = L = 6 without the corpus and
    sampled."""
    n, length = sampled_cell
    branches_only = " verified_ngrams=false"
    grid_cells = [{"name": f"selfdraft N={a} L={b}{branches_only}", "N": a, "L": b, "corpus": True,
                   "verified": False, "temperature": 0.0} for a, b in itertools.product(grid, grid)]
    # the paper's own cell and its variants first, then the rest of the grid, fewest rows first: a run cut short
    # has the headline figures
    grid_cells.sort(key=lambda c: ((c["N"], c["L"]) != (n, length), c["N"] * c["L"]))
    default = {"N": n, "L": length, "corpus": True, "verified": True, "temperature": 0.0}
    return [{"name": "ar", "temperature": 0.0}, {**default, "name": f"selfdraft N={n} L={length}"},
            {**default, "name": f"selfdraft N={n} L={length} corpus_ngrams=false", "corpus": False},
            {"name": "ar T=1", "temperature": 1.0},
            {**default, "name": f"selfdraft N={n} L={length} T=1", "temperature": 1.0},
            {"name": "lookup m=7", "temperature": 0.0}, grid_cells[0],
            {**grid_cells[0], "name": f"selfdraft N={n} L={length} corpus_ngrams=false{branches_only}",
             "corpus": False},
            {**grid_cells[0], "name": f"selfdraft N={n} L={length} T=1{branches_only}", "temperature": 1.0},
            *grid_cells[1:]]


def decoder_for(cell: dict, staged: StagedTarget, eos: frozenset[int], corpus):
    """What `method=selfdraft` (spd.drafters.selfdraft.chain_drafter), `method=lookup` and `method=ar` build."""
    if cell["name"].startswith("ar"):
        return build_decoder(AR, staged, eos), None
    if cell["name"].startswith("lookup"):
        return build_decoder(CHAIN, staged, eos, LookupDrafter(2, 8), draft_length=METHODS["lookup"].draft_length), None
    drafter = SelfDraftDrafter(cell["N"], cell["L"], GRAM, corpus if cell["corpus"] else None,
                               verified_ngrams=cell["verified"])
    return build_decoder(CHAIN, staged, eos, drafter, draft_length=METHODS["selfdraft"].draft_length), drafter


def summary(records: list[dict], cell_list: list[dict]) -> list[dict]:
    """Per cell: τ over each set and over both (tokens after the first / forwards), equality with AR (by the
    outputs' checksums), seconds."""
    reference = {(r["key"], r["temperature"]): r["crc"] for r in records if r["cell"].startswith("ar")}
    rows = []
    for cell in cell_list:
        mine = [r for r in records if r["cell"] == cell["name"]]
        for r in mine:
            if not r["cell"].startswith("ar") and (r["key"], r["temperature"]) in reference:
                r["equal_ar"] = r["crc"] == reference[r["key"], r["temperature"]]
        row = {k: v for k, v in cell.items()}
        for name, subset in [("all", mine)] + [(s, [r for r in mine if r["set"] == s]) for s in SETS]:
            tokens = sum(r["N"] - 1 for r in subset)
            cycles = sum(r["cycles"] for r in subset)
            row[name] = {"prompts": len(subset), "tokens": tokens, "forwards": cycles,
                         "tau": tokens / cycles if cycles else None,
                         "kept": sum(r["accepted"] for r in subset), "drafted": sum(r["drafted"] for r in subset),
                         "seconds": sum(r["seconds"] for r in subset)}
        checked = [r["equal_ar"] for r in mine if r.get("equal_ar") is not None]
        row["equal_ar"] = f"{sum(checked)}/{len(checked)}" if checked else None
        rows.append(row)
    return rows


def table(rows: list[dict], grid: list[int]) -> str:
    """The N × L grid of τ (both sets), then every cell's τ per set."""
    tau = {(r.get("N"), r.get("L")): r["all"]["tau"] for r in rows
           if r["name"].startswith("selfdraft") and r.get("corpus") and r["temperature"] == 0 and not r["verified"]}
    lines = ["| N \\ L | " + " | ".join(map(str, grid)) + " |", "|---|" + "---:|" * len(grid)]
    for n in grid:
        lines.append(f"| {n} | " + " | ".join(f"{tau[n, length]:.3f}" if tau.get((n, length)) else "—"
                                                 for length in grid) + " |")
    lines += ["", "| cell | T | HumanEval τ | MT-Bench τ | both τ | = AR |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        taus = [r[s]["tau"] for s in (*SETS, "all")]
        lines.append(f"| {r['name']} | {r['temperature']:g} | " +
                     " | ".join(f"{t:.3f}" if t else "—" for t in taus) + f" | {r['equal_ar'] or '—'} |")
    return "\n".join(lines)


def read(progress: str) -> list[dict]:
    if not os.path.isfile(progress):
        return []
    with open(progress) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--limit", type=int, default=10, help="first prompts of each of HumanEval and MT-Bench")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--grid", default="2,4,6,8", help="the N and L values (every pair)")
    ap.add_argument("--sampled-cell", default="6,6", help="N,L of the T = 1 cell")
    ap.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (τ does not change with them)")
    ap.add_argument("--shard", default="0/1", help="i/k: this process decodes every k-th (cell, prompt) from the i-th; "
                    "k processes share one X.jsonl, and the last to finish writes X.json")
    ap.add_argument("--out", default="docs/results/selfdraft_ablation.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shard, shards = (int(x) for x in args.shard.split("/"))
    grid = [int(x) for x in args.grid.split(",")]
    cell_list = cells(grid, tuple(int(x) for x in args.sampled_cell.split(",")))
    loaded = load_target(args.target)
    staged, eos = StagedTarget(loaded.model, 1), eos_ids_of(loaded.model.config, loaded.tokenizer)
    corpus = corpus_ngrams(loaded.tokenizer, loaded.model.config.vocab_size, GRAM)
    if corpus is None:
        print("selfdraft_ablation: no corpus n-grams here (the ShareGPT datastore cannot be built)", file=sys.stderr)
        return 1
    prompts = [(ds, f"{ds}/{q['question_id']}", chat_prompt_ids(loaded.tokenizer, q["turns"][0]))
               for ds in SETS for q in load_questions(ds)[: args.limit]]
    progress = args.out[: -len(".json")] + ".jsonl" if args.out.endswith(".json") else args.out + ".jsonl"
    done = {(r["cell"], r["key"]) for r in read(progress)}
    work = [(cell, p) for cell in cell_list for p in prompts]
    work = [item for i, item in enumerate(work) if i % shards == shard and (item[0]["name"], item[1][1]) not in done]
    os.makedirs(os.path.dirname(os.path.abspath(progress)), exist_ok=True)
    with open(progress, "a") as out:
        for cell, (ds, key, ids) in tqdm(work, desc="cells x prompts", unit="decode"):
            decoder, drafter = decoder_for(cell, staged, eos, corpus)
            t = cell["temperature"]
            start = time.perf_counter()
            result = decoder.generate(ids, Request(args.max_new_tokens, params_for(t), seed_of(key)))
            seconds = time.perf_counter() - start
            record = {"cell": cell["name"], "set": ds, "key": key, "temperature": t, "seconds": seconds,
                      "crc": zlib.crc32(json.dumps(result.token_ids).encode()), "threads": torch.get_num_threads()}
            if cell["name"].startswith("ar"):
                record.update(N=len(result.token_ids), cycles=len(result.token_ids) - 1, accepted=0, drafted=0)
            else:
                stats = result.stats
                record.update(N=stats.N, cycles=stats.cycles, accepted=stats.accepted, drafted=stats.drafted,
                              grams_added=getattr(drafter, "grams_added", None))
            out.write(json.dumps(record) + "\n")     # one line a write: shards append to one file
            out.flush()
    records = read(progress)
    rows = summary(records, cell_list)
    write_json(args.out, {"rows": rows, "grid": grid, "gram": GRAM, "sets": list(SETS), "limit": args.limit,
                          "max_new_tokens": args.max_new_tokens, "target": args.target, "cpu": _cpu_name(),
                          "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "machine": platform.machine(),
                          "command": " ".join(["python", "-m", "bench.selfdraft_ablation", *sys.argv[1:]])})
    print(table(rows, grid))
    return 0


if __name__ == "__main__":
    sys.exit(main())
