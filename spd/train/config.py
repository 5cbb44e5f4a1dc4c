"""The trainer's structured config. Every DeepSpeed setting is explicit here (never "auto")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


from spd.config import WandbSection, at_least, one_of
from spd.errors import UserError
from spd.methods import METHODS, TRAINED_METHODS


@dataclass
class ModelSection:
    target: str = "smollm2"             # "smollm2", "tiny-llama" (random, for checks), an HF dir or a .gguf file
    n: int = 5
    stage_bounds: Optional[List[int]] = None
    module_layers: int = 1              # L_s
    draft_vocab: int = 16384            # 0 = the full vocabulary
    init_fc: str = "random"             # random | select: FC_k starts as a selector of H^{b_k} (FC_0 of H^0)
    init_layers: Optional[List[int]] = None  # copy these target layers into the module's layers (one each)
    feature_norm: str = "none"          # none | standard: each H^l standardised per dimension before the FCs
    feature_norm_examples: int = 16     # training conversations whose states set that standardisation
    fc_bias: bool = False               # a bias in every FC_k (the paper's are bias-free)
    init_attention: str = "random"      # random | previous: head 0 starts attending to row t-1 (needs fc_bias)

    @staticmethod
    def check(m) -> None:
        for key in ("n", "module_layers"):
            at_least(m, key, 1)
        at_least(m, "draft_vocab", 0, " (0 = the full vocabulary)")
        one_of(m, "init_fc", ("random", "select"))
        one_of(m, "feature_norm", ("none", "standard"))
        one_of(m, "init_attention", ("random", "previous"))
        if m.init_attention == "previous" and not m.fc_bias:
            raise UserError("model.init_attention=previous needs model.fc_bias=true (a position needs a constant "
                            "component to be found by); set both")
        at_least(m, "feature_norm_examples", 1)


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

    @staticmethod
    def check(d) -> None:
        for key, low in (("max_conversations", 1), ("max_length", 2), ("heldout", 0), ("regenerate_temperature", 0),
                         ("regenerate_new_tokens", 1), ("regenerate_batch", 1)):
            at_least(d, key, low)


@dataclass
class OptimSection:
    lr: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    steps: int = 1000                   # optimizer steps; lr decays linearly to 0 at the last one

    @staticmethod
    def check(o) -> None:
        if not o.lr > 0:
            raise UserError(f"optim.lr={o.lr} must be a positive learning rate (e.g. 1e-4)")
        at_least(o, "steps", 1, " (optimizer steps to train)")
        for key in ("warmup_steps", "weight_decay", "grad_clip"):
            at_least(o, key, 0)
        if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
            raise UserError(f"optim.betas={list(o.betas)} must be two numbers in [0, 1), e.g. [0.9, 0.95]")


@dataclass
class DeepSpeedSection:
    batch_size: int = 8                 # sequences per optimizer step, all ranks together
    micro_batch: int = 1                # sequences per rank per forward
    accumulation: int = 8               # micro-batches per optimizer step
    zero_stage: int = 0
    precision: str = "fp32"             # fp32 | bf16 | fp16

    @staticmethod
    def check(ds) -> None:
        for key in ("batch_size", "micro_batch", "accumulation"):
            at_least(ds, key, 1)
        one_of(ds, "zero_stage", (0, 1, 2, 3))
        one_of(ds, "precision", ("fp32", "bf16", "fp16"))


@dataclass
class TrainConfig:
    method_choices = TRAINED_METHODS     # not a key: the methods `method` takes (--help lists them from spd.methods)
    method: str = "spd"                 # what is trained (spd_output_state: the paper's Table 2 ablation)
    output_dir: str = "outputs/train"   # config.json, metrics.jsonl, checkpoint/, ds_state/ (the resumable state)
    seed: int = 0
    resume: bool = False                # continue the run in output_dir from its ds_state/ (Ctrl-C, SIGTERM save one)
    # continue a trained module's distillation (a checkpoint directory or a shipped module's name, e.g. smollm2-n5):
    # its weights, draft vocabulary and feature standardisation start the run; its steps and tokens count on
    init_from: Optional[str] = None
    log_every: int = 1
    eval_every: int = 0                 # 0 = only at the end
    eval_decodes: int = 4               # greedy decodes for the L'acc estimate
    eval_new_tokens: int = 48
    save_every: int = 0                 # 0 = only at the end (and when stopped by Ctrl-C or SIGTERM)
    keep_checkpoints: bool = False      # also keep checkpoints/step-XXXXX at every save (for curves)
    p_full: float = 0.5                 # probability of a full pipeline in the simulated occupancy (paper: 0.5)
    occupancy_weights: Optional[List[float]] = None  # instead of the paper's policy: P(a=1..n), e.g. as measured
    teacher_cache: bool = False         # compute the teacher's needed hidden states once, reuse them every epoch
    teacher_cache_dir: str = "outputs/cache/teacher"
    teacher_cache_dtype: str = "float16"  # float16 halves the disk; float32 keeps the teacher's exact values
    # H^l to store beside the run's own when the cache entry is written, so runs at other n or of other methods on
    # the same data reuse that one entry (e.g. the union of what n = 3, n = 8 and EAGLE-3 read)
    teacher_cache_layers: List[int] = field(default_factory=list)
    overwrite: bool = False             # start afresh in output_dir when it holds a run (that run is deleted)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    wandb: WandbSection = field(default_factory=WandbSection)

    @staticmethod
    def check(cfg) -> None:
        one_of(cfg, "method", TRAINED_METHODS)
        if not METHODS[cfg.method].pipelined:     # the keys below shape a pipelined method's module
            m = cfg.model
            pipelined_only = {"model.module_layers": m.module_layers != 1, "model.init_fc": m.init_fc != "random",
                              "model.init_layers": m.init_layers is not None, "model.fc_bias": m.fc_bias,
                              "model.feature_norm": m.feature_norm != "none",
                              "model.init_attention": m.init_attention != "random",
                              "occupancy_weights": cfg.occupancy_weights is not None}
            bad = [key for key, set_ in pipelined_only.items() if set_]
            if bad:
                raise UserError(f"{', '.join(bad)} shape SPD's module, not EAGLE-3's (one layer, fixed inputs); "
                                "leave them at their defaults with method=eagle3")
        for key, low in (("seed", 0), ("log_every", 1), ("eval_every", 0), ("eval_decodes", 0), ("eval_new_tokens", 1),
                         ("save_every", 0)):
            at_least(cfg, key, low)
        if not 0 <= cfg.p_full <= 1:
            raise UserError(f"p_full={cfg.p_full} must be a probability in [0, 1]")
        one_of(cfg, "teacher_cache_dtype", ("float16", "float32"))
        weights = list(cfg.occupancy_weights) if cfg.occupancy_weights is not None else None
        if weights is not None and (len(weights) != cfg.model.n or min(weights) < 0 or sum(weights) <= 0):
            raise UserError(f"occupancy_weights={weights} needs {cfg.model.n} non-negative entries (a=1..n), not all 0")
        if cfg.resume and cfg.overwrite:
            raise UserError("resume=true and overwrite=true contradict each other; choose one")
