"""`spd-infer eval`'s structured config (OmegaConf; YAML in configs/eval/, key=value overrides, unknown keys rejected)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from spd.config import WandbSection, at_least, check_decoding
from spd.paths import default_trace_cache_dir
from spd.spec import DecodeKeys, own_defaults


# the paper's protocol: 512 new tokens, and where it samples T=1 with top-k 50 and top-p 1.0; a fixed seed
@dataclass
@own_defaults(max_new_tokens=512, top_k=50, seed=0)
class EvalConfig(DecodeKeys):
    """`spd-infer eval`: the decoding keys (spd.spec.DecodeKeys, the protocol's defaults above), what to score and
    where the results go."""
    datasets: List[str] = field(default_factory=lambda: ["mt_bench", "gsm8k", "humaneval"])  # first turns, in order
    limit: Optional[int] = None         # the first `limit` prompts of each data set (limit=2: 2 of MT-Bench, 2 of
                                        # GSM8K, 2 of HumanEval); None = all 80 of each
    exact_trace: bool = False           # T=0: run the step-by-step runtime instead of the exact fast evaluator
    ar_baseline: bool = True            # runtime samples: also decode with plain AR (lossless check + tokens/s)
    calibrate: bool = True              # measure stage/module/head/verify times for the measured-cost speedup
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
    wandb: WandbSection = field(default_factory=WandbSection)

    @staticmethod
    def check(cfg) -> None:
        check_decoding(cfg)
        at_least(cfg, "limit", 1, " (prompts per dataset; null = all)")
        at_least(cfg, "batch_size", 1, " (prompts per forward when recording traces)")
