"""The trainer's structured config. Every DeepSpeed setting is explicit here (never "auto")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from spd.config import WandbSection


@dataclass
class ModelSection:
    target: str = "smollm2"             # "smollm2", "tiny-llama" (random, for checks), an HF dir or a .gguf file
    n: int = 5
    stage_bounds: Optional[List[int]] = None
    module_layers: int = 1              # L_s
    draft_vocab: int = 16384            # 0 = the full vocabulary
    init_fc: str = "random"             # random | select: FC_k starts as a selector of H^{b_k} (FC_0 of H^0)
    init_layers: Optional[List[int]] = None  # copy these target layers into the module's layers (one each)


@dataclass
class DataSection:
    path: str = "sharegpt"              # "sharegpt" (packaged ShareGPT V3) or a JSON / JSONL / parquet file
    max_conversations: int = 4000
    max_length: int = 1024              # conversations longer than this (tokens) are dropped
    heldout: int = 16                   # conversations kept out of training for eval
    regenerate: bool = False            # replace assistant replies by the target's own (first user turn kept)
    regenerate_temperature: float = 0.0  # 0 = greedy replies
    regenerate_new_tokens: int = 512
    regenerate_batch: int = 16          # prompts per generate call
    regenerated_dir: str = "outputs/cache/regenerated"


@dataclass
class OptimSection:
    lr: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    steps: int = 1000                   # optimizer steps; lr decays linearly to 0 at the last one


@dataclass
class DeepSpeedSection:
    batch_size: int = 8                 # sequences per optimizer step, all ranks together
    micro_batch: int = 1                # sequences per rank per forward
    accumulation: int = 8               # micro-batches per optimizer step
    zero_stage: int = 0
    precision: str = "fp32"             # fp32 | bf16 | fp16


@dataclass
class TrainConfig:
    output_dir: str = "outputs/train"
    seed: int = 0
    resume: bool = False
    log_every: int = 1
    eval_every: int = 0                 # 0 = only at the end
    eval_decodes: int = 4               # greedy decodes for the L'acc estimate
    eval_new_tokens: int = 48
    save_every: int = 0                 # 0 = only at the end
    keep_checkpoints: bool = False      # also keep checkpoints/step-XXXXX at every save (for curves)
    p_full: float = 0.5                 # probability of a full pipeline in the simulated occupancy (paper: 0.5)
    occupancy_weights: Optional[List[float]] = None  # instead of the paper's policy: P(a=1..n), e.g. as measured
    teacher_cache: bool = False         # compute the teacher's needed hidden states once, reuse them every epoch
    teacher_cache_dir: str = "outputs/cache/teacher"
    teacher_cache_dtype: str = "float16"  # float16 halves the disk; float32 keeps the teacher's exact values
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    wandb: WandbSection = field(default_factory=WandbSection)
