"""`spd-infer eval`'s structured config (OmegaConf; YAML in configs/eval/, key=value overrides, unknown keys rejected)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from spd.config import WandbSection, at_least, check_decoding
from spd.paths import default_trace_cache_dir


@dataclass
class EvalConfig:
    target: str = "smollm2"             # "smollm2", an HF model directory, a .gguf file, or tiny-<family>
    checkpoint: Optional[str] = None    # module directory; None = the shipped one for the run's n, random = untrained
    method: Optional[str] = None        # None = the checkpoint's (spd without one)
    draft_length: Optional[int] = None  # method=eagle3 | lookup: at most m drafts per target forward; None = the
                                        # method's own (eagle3 5, lookup 7)
    W: int = 1                          # draft-tree width: children per node (1 = a chain); W > 1: method=eagle3 | lookup
    tree_nodes: int = 16                # W > 1: drafted nodes per verification (the tree's budget)
    children: Optional[int] = None      # W > 1, pipelined methods: candidates drafted per tip (PipeDec's c; None = W)
    draft_layers: int = 1               # method=pipedec: the draft model is the target's first k layers (early exit)
    segment: int = 4                    # method=flowspec: S, nodes per segment
    draft_source: Optional[str] = None  # spd, ppsd, spd_output_state: module | lookup+module (spd.drafters.hybrid);
                                        # flowspec: suffix | lookup; None = the method's first
    branches: int = 6                   # method=selfdraft: N, draft branches beside each verification forward
    branch_length: int = 6              # method=selfdraft: L, tokens a draft branch keeps
    gram: int = 4                       # method=selfdraft: G, the n-grams of its context and corpus caches
    corpus_ngrams: bool = True          # method=selfdraft: the ShareGPT datastore's n-grams fill the candidates too
    lookup_min_ngram: int = 2           # lookup, lookup+module: shortest suffix of the context that may match earlier
    lookup_max_ngram: int = 8           # lookup, lookup+module: longest suffix compared
    draft_pricing: bool = True          # suffix: drafts priced per cycle (spd.pricing; generate's key)
    source_pricing: bool = False        # lookup+module: the source priced per step (spd.pricing.SourcePricer)
    datastore: Optional[str] = None     # suffix: a corpus's continuations as candidates too (sharegpt, answers, a
                                        # file, or several joined by +: spd.retrieval)
    datasets: List[str] = field(default_factory=lambda: ["mt_bench", "gsm8k", "humaneval"])  # first turns, in order
    limit: Optional[int] = None         # the first `limit` prompts of each dataset; None = all 80
    n: Optional[int] = None             # None = the checkpoint's n, else 5
    stage_bounds: Any = None            # inner boundaries b_1..b_{n-1}, or "balanced" (by measured cost)
    module_layers: int = 1              # L_s of a randomly initialised module
    module_cache: bool = True           # cache K/V of depth-n memory rows (exact: they never change)
    max_new_tokens: int = 512           # the paper's protocol
    temperature: float = 0.0            # 0 = greedy; the paper's sampled setting is T=1, top-k 50, top-p 1.0
    top_k: int = 50                     # used when temperature > 0
    top_p: float = 1.0                  # used when temperature > 0 (1 = off)
    seed: int = 0                       # each prompt's generator is seeded from (seed, dataset, question_id)
    exact_trace: bool = False           # T=0: run the step-by-step runtime instead of the exact fast evaluator
    ar_baseline: bool = True            # runtime samples: also decode with plain AR (lossless check + tokens/s)
    calibrate: bool = True              # measure stage/module/head/verify times for the measured-cost speedup
    dtype: Optional[str] = None         # float32 | bfloat16 | float16 (None: bfloat16 on CUDA, float32 elsewhere)
    device: str = "cpu"                 # cpu | cuda | cuda:N | mps
    output_dir: str = "outputs/eval/run"  # samples.jsonl, summary.json, table.md, plots; a relative path is under the
                                        # directory spd-infer runs in: point output_dir= where the results belong
    resume: bool = True                 # skip samples already in output_dir/samples.jsonl (same config only)
    # the target's greedy decodes, reused across evals: beside the target weights cache, under $SPD_CACHE_DIR
    # (default ~/.cache/spd)/traces, whatever directory eval runs in
    trace_cache_dir: str = field(default_factory=default_trace_cache_dir)
    batch_size: int = 1                 # prompts per target forward: the greedy traces' recording, and the
                                        # step-by-step samples with their AR references (runtime=local); 1: one at a
                                        # time, the only way each sample's tokens/s is measured
    # H^l to record beside the run's own when a trace directory is made, so evals at other n and EAGLE-3's reuse
    # the same greedy decodes (a trace directory that stores a run's layers serves it, whatever its layout)
    trace_layers: List[int] = field(default_factory=list)
    runtime: str = "local"              # local | distributed (one process per stage; always the step-by-step runtime)
                                        # | streams (one CUDA stream per stage; CUDA only)
    cuda_graphs: bool = False           # stage steps (and the AR baseline) as CUDA graphs (CUDA only)
    compile: bool = False               # runtime=device: the step through torch.compile (fullgraph, inductor)
    threads_per_stage: Optional[int] = None  # distributed: intra-op threads per process (None: cores // processes)
    controller: str = "auto"            # distributed: own_process | first_stage | auto (as for generate)
    master_addr: str = "127.0.0.1"      # distributed: where the controller hosts the rendezvous
    master_port: int = 0                # distributed: 0 = any free port
    timeout_s: float = 20.0             # distributed: longest wait for any message inside a generation
    wandb: WandbSection = field(default_factory=WandbSection)

    @staticmethod
    def check(cfg) -> None:
        check_decoding(cfg)
        at_least(cfg, "limit", 1, " (prompts per dataset; null = all)")
        at_least(cfg, "batch_size", 1, " (prompts per forward when recording traces)")
