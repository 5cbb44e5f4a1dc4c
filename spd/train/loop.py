"""The distillation loop: DeepSpeed engine around the module only; frozen teacher; tqdm; W&B; checkpoints; resume.

Data order and occupancy are pure functions of (seed, step), so a resumed run sees exactly what an
uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import sys
import time

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from spd.models.checkpoint import save_checkpoint
from spd.errors import UserError
from spd.models.module import SpeculationModule
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget
from spd.train.continuation import load_continued
from spd.train.data import load_conversations, tokenize_conversations
from spd.train.feature_cache import build_or_load
from spd.train.regenerate import regenerate, regenerated_path
from spd.train.methods import objective_for
from spd.train.objective import build_draft_vocab, collate, teacher_pass, teacher_targets
from spd.train.preflight import DS_STATE, check_paths, check_resumable

PRECISION = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
METRICS_FILE = "metrics.jsonl"


# The deepspeed launcher (deepspeed.launcher.launch) answers Ctrl-C, or a SIGTERM of its own, by sending each
# trainer process SIGTERM and, 30 s later, SIGKILL: the trainer treats SIGTERM as Ctrl-C. A scheduler's SIGTERM
# (Slurm, Kubernetes, a box's deadline) is answered the same way.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Ctrl-C or SIGTERM while training: stop after the micro-batch under way, save a resumable state, exit (a second
    Ctrl-C stops at once; a second SIGTERM changes nothing). The save holds the last whole optimizer step: a step cut
    short is dropped (no update was made from it) and trained again on resume, exactly (data order and occupancy are
    functions of (seed, step)). Stopping at a micro-batch rather than at the step keeps the save inside the
    launcher's 30 s. Every rank stops after the same micro-batch: the request is agreed on by all of them."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.requested = False
        self.device = device   # where the agreement's flag lives (nccl reduces only CUDA tensors)

    def __enter__(self):
        self.previous = {sig: signal.signal(sig, self._request) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _request(self, signum, frame) -> None:
        self.requested = True
        if signum == signal.SIGINT:   # a second Ctrl-C: the previous handler (KeyboardInterrupt at once)
            signal.signal(signal.SIGINT, self.previous[signal.SIGINT])

    def agreed(self, world: int) -> bool:
        if world == 1:
            return self.requested
        flag = torch.tensor([int(self.requested)], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag)


def cut_metrics(path: str, step: int) -> None:
    """Keep the metrics of steps 1..step: the steps after the last checkpoint are trained again on resume."""
    if not os.path.isfile(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):  # a line torn by the interruption
                continue
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@contextlib.contextmanager
def distributed():
    """(rank, world) of one process (python train/run.py) or many (deepspeed / torchrun): gloo on CPU, nccl on CUDA.
    What it set up it takes down on the way out — the process group it created and the environment variables it
    added — so a caller in the same process (a test, a notebook) is not left looking like a torchrun worker."""
    import deepspeed
    import torch.distributed as dist

    added = {key: value for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                           "MASTER_ADDR": "127.0.0.1"}.items() if key not in os.environ}
    if "MASTER_PORT" not in os.environ:
        added["MASTER_PORT"] = _free_port()
    os.environ.update(added)
    created = not dist.is_initialized()
    try:
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        yield int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
        for key in added:
            os.environ.pop(key, None)


def deepspeed_config(cfg, world: int) -> dict:
    ds = cfg.deepspeed
    if ds.micro_batch * ds.accumulation * world != ds.batch_size:
        raise UserError(f"deepspeed.micro_batch ({ds.micro_batch}) x accumulation ({ds.accumulation}) x world size "
                        f"({world}) = {ds.micro_batch * ds.accumulation * world}, not batch_size={ds.batch_size}")
    return {"train_batch_size": ds.batch_size, "train_micro_batch_size_per_gpu": ds.micro_batch,
            "gradient_accumulation_steps": ds.accumulation, "gradient_clipping": cfg.optim.grad_clip,
            "zero_optimization": {"stage": ds.zero_stage},
            "bf16": {"enabled": ds.precision == "bf16"}, "fp16": {"enabled": ds.precision == "fp16"},
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def linear_schedule(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))
    return factor


def micro_batches(num_examples: int, seed: int, step: int, rank: int, world: int, micro: int, accumulation: int):
    """Example indices for each micro-batch of optimizer step `step` on `rank`: epochs of seeded permutations."""
    per_step = micro * accumulation * world
    start = step * per_step
    out = []
    for a in range(accumulation):
        idx = []
        for j in range(micro):
            flat = start + (a * world + rank) * micro + j
            epoch, offset = divmod(flat, num_examples)
            order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 1000003 + epoch))
            idx.append(int(order[offset]))
        out.append(idx)
    return out


def regenerated_conversations(cfg, loaded, convs, log):
    """The target's own replies to the conversations' first user turns (rank 0 writes them, once per settings)."""
    d = cfg.data
    settings = {"temperature": d.regenerate_temperature, "new_tokens": d.regenerate_new_tokens,
                "max_length": d.max_length, "seed": cfg.seed}
    path = regenerated_path(d.regenerated_dir, loaded.fingerprint, d.path, convs, settings)
    distributed = torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_rank() == 0:
        regenerate(loaded.model, loaded.tokenizer, convs, path, temperature=d.regenerate_temperature,
                   max_new_tokens=d.regenerate_new_tokens, max_prompt_tokens=d.max_length - d.regenerate_new_tokens,
                   batch_size=d.regenerate_batch, seed=cfg.seed, log=log)
    if distributed:
        torch.distributed.barrier()
    return load_conversations(path, len(convs))


@torch.no_grad()
def feature_samples(staged: StagedTarget, examples: list[dict], layers: list[int]) -> dict[int, torch.Tensor]:
    """{layer: [M, d]} the given layers' hidden states at every token of `examples` (one unpadded forward each)."""
    capture = frozenset(layers)
    rows: dict[int, list[torch.Tensor]] = {layer: [] for layer in capture}
    for ex in examples:
        _, hidden = staged.forward_all(torch.tensor([ex["input_ids"]], device=staged.device), None, capture=capture)
        for layer in capture:
            rows[layer].append(hidden[layer][0])
    return {layer: torch.cat(parts) for layer, parts in rows.items()}


def examples_sha256(examples: list[dict]) -> str:
    """Identity of the training data as the module saw it: every example's token ids and loss mask."""
    digest = hashlib.sha256()
    for ex in examples:
        digest.update(json.dumps([ex["input_ids"], ex["loss_mask"]]).encode())
    return digest.hexdigest()


def gradient_norms(module: SpeculationModule) -> dict[str, float]:
    """The whole gradient's norm and each part's: which FC_k, the layers and the head actually learn."""
    def norm(params) -> float:
        grads = [p.grad for p in params if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
    out = {"grad_norm": norm(module.parameters())}
    if isinstance(module, SpeculationModule):
        out.update({f"grad_norm/fc{k}": norm(fc.parameters()) for k, fc in module.fc.items()})
        out["grad_norm/layers"] = norm(module.layers.parameters())
    else:   # EAGLE-3: one FC, one layer
        out.update({"grad_norm/fc": norm(module.fc.parameters()), "grad_norm/layers": norm(module.layer.parameters())})
    out["grad_norm/head"] = norm(module.head.parameters())
    return out


def prepare(cfg, log):
    """Target, stages, data splits, draft vocabulary, module (everything but the engine)."""
    loaded = load_target(cfg.model.target, torch.float32, "cuda" if torch.cuda.is_available() else "cpu")
    if loaded.tokenizer is None:
        raise UserError(f"target {cfg.model.target!r} has no tokenizer; training needs its chat template")
    L = loaded.model.config.num_hidden_layers
    if not 1 <= cfg.model.n <= L:
        raise UserError(f"model.n={cfg.model.n} must be within 1..{L} for this target")
    try:
        staged = StagedTarget(loaded.model, cfg.model.n, list(cfg.model.stage_bounds) if cfg.model.stage_bounds else None)
    except ValueError as exc:      # bounds that do not fit this target's layers
        raise UserError(f"model.{exc}") from None
    convs = load_conversations(cfg.data.path, cfg.data.max_conversations + cfg.data.heldout)
    if cfg.data.regenerate:
        convs = regenerated_conversations(cfg, loaded, convs, log)
    order = torch.randperm(len(convs), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    held_convs = [convs[i] for i in order[: cfg.data.heldout]]
    train_convs = [convs[i] for i in order[cfg.data.heldout:]]
    train = tokenize_conversations(loaded.tokenizer, train_convs, cfg.data.max_length, log)
    held = tokenize_conversations(loaded.tokenizer, held_convs, cfg.data.max_length, log) if held_convs else []
    objective = objective_for(cfg)
    if cfg.init_from:      # the module's own draft vocabulary and standardisation come with it
        module, continued = load_continued(cfg, staged, loaded)
        return loaded, staged, train, held, held_convs, module.draft_to_target, module, objective, continued
    draft = None
    if cfg.model.draft_vocab:
        draft = build_draft_vocab(train, cfg.model.draft_vocab, loaded.model.config.vocab_size).to(staged.device)
    module = objective.build(staged, draft, lambda: feature_samples(staged, train[: cfg.model.feature_norm_examples],
                                                                    objective.layers(staged)))
    return loaded, staged, train, held, held_convs, draft, module, objective, None


def train(cfg) -> dict:
    check_paths(cfg)
    with distributed() as (rank, world):
        return _train(cfg, rank, world)


def _train(cfg, rank: int, world: int) -> dict:
    import deepspeed

    log = (lambda msg: tqdm.write(f"[train] {msg}")) if rank == 0 else (lambda msg: None)
    out_dir = cfg.output_dir
    resolved = OmegaConf.to_container(cfg, resolve=True)
    cfg_path = os.path.join(out_dir, "config.json")
    if cfg.resume:
        check_resumable(cfg, resolved)
    ds_config = deepspeed_config(cfg, world)
    weights = list(cfg.occupancy_weights) if cfg.occupancy_weights else None
    torch.manual_seed(cfg.seed)
    loaded, staged, train_set, held, held_convs, draft, module, objective, continued = prepare(cfg, log)
    # a continued run counts on from the module's steps and tokens, and its data order starts where they stopped
    prior_steps, prior_tokens = (continued.step, continued.tokens) if continued else (0, 0)
    layers = objective.layers(staged)
    outside = [l for l in cfg.teacher_cache_layers if not 0 <= l <= staged.num_layers]
    if outside:
        raise UserError(f"teacher_cache_layers has {outside}, outside this target's hidden states 0..{staged.num_layers}; "
                        "drop them")
    features = None
    if cfg.teacher_cache:
        # rank 0 writes the cache; the others open it once it exists
        if rank == 0:
            features = build_or_load(staged, loaded.fingerprint, train_set, cfg.teacher_cache_dir,
                                     cfg.teacher_cache_dtype, log, layers, list(cfg.teacher_cache_layers))
        torch.distributed.barrier()
        if features is None:
            features = build_or_load(staged, loaded.fingerprint, train_set, cfg.teacher_cache_dir,
                                     cfg.teacher_cache_dtype, log=lambda m: None, layers=layers,
                                     extra_layers=list(cfg.teacher_cache_layers))
    module.to(PRECISION[cfg.deepspeed.precision]).train()
    optimizer = torch.optim.AdamW(module.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                  weight_decay=cfg.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(cfg.optim.warmup_steps, cfg.optim.steps))
    engine, optimizer, _, scheduler = deepspeed.initialize(model=module, optimizer=optimizer,
                                                           lr_scheduler=scheduler, config=ds_config)
    start, tokens_seen = 0, prior_tokens
    ds_dir = os.path.join(out_dir, DS_STATE)
    if cfg.resume:
        _, client = engine.load_checkpoint(ds_dir)
        if client is None:
            raise UserError(f"resume=true but {ds_dir!r} holds no DeepSpeed state; pass overwrite=true instead of "
                            "resume=true to start afresh there")
        start, tokens_seen = int(client["step"]), int(client.get("tokens_seen", 0))
        log(f"resumed at step {start}")
        if rank == 0:
            cut_metrics(os.path.join(out_dir, METRICS_FILE), start)
    if rank == 0:
        if cfg.overwrite and os.path.isdir(out_dir):  # only now: a refused run must not lose the old one
            shutil.rmtree(out_dir)
        os.makedirs(out_dir, exist_ok=True)
        tmp = cfg_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(resolved, f, indent=2)
        os.replace(tmp, cfg_path)
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(cfg))
    run = None
    if rank == 0 and cfg.wandb.mode != "disabled":
        import wandb  # imported only when used: it is slow to import and optional on bare machines

        run = wandb.init(mode=cfg.wandb.mode, project=cfg.wandb.project, name=cfg.wandb.name, dir=out_dir,
                         config=resolved, resume="allow")
    pad = loaded.tokenizer.pad_token_id or 0
    extra = {"training": {"command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
                          "data_sha256": examples_sha256(train_set),
                          "data": cfg.data.path, "regenerated": cfg.data.regenerate, "steps": cfg.optim.steps,
                          "init_fc": cfg.model.init_fc, "init_layers": resolved["model"]["init_layers"],
                          "feature_norm": cfg.model.feature_norm, "fc_bias": cfg.model.fc_bias,
                          "init_attention": cfg.model.init_attention,
                          "occupancy_weights": weights, "lr": cfg.optim.lr,
                          **({"continued_from": continued.record()} if continued else {})}}
    def save(done: int, tokens_done: int) -> None:
        engine.save_checkpoint(ds_dir, tag=f"step{done}", client_state={"step": done, "tokens_seen": tokens_done})
        if rank == 0:
            for old in os.listdir(ds_dir):  # keep only the state `latest` points to (optimizer state is large)
                if old.startswith("step") and old != f"step{done}":
                    shutil.rmtree(os.path.join(ds_dir, old), ignore_errors=True)
            meta = {**extra, "step": prior_steps + done, "train_tokens": tokens_done}
            save_checkpoint(module, loaded, os.path.join(out_dir, "checkpoint"), meta)
            if cfg.keep_checkpoints:
                save_checkpoint(module, loaded, os.path.join(out_dir, "checkpoints", f"step-{done:05d}"), meta)

    summary = {}
    stop = StopRequest(staged.device)
    bar = tqdm(range(start, cfg.optim.steps), initial=start, total=cfg.optim.steps, disable=rank != 0, desc="train")
    with stop:
        for step in bar:
            t0 = time.perf_counter()
            losses, agree, groups, tokens, excluded = [], [], {}, 0, 0
            occ_gen = torch.Generator().manual_seed(cfg.seed * 7919 + (prior_steps + step) * 31 + rank)
            tokens_before = tokens_seen
            for micro, idx in enumerate(micro_batches(len(train_set), cfg.seed, prior_steps + step, rank, world,
                                                      cfg.deepspeed.micro_batch, cfg.deepspeed.accumulation)):
                if micro and stop.agreed(world):   # stopped inside a step: save the last whole one, drop this one
                    save(step, tokens_before)
                    log(f"stopped inside step {step + 1}: saved step {step} in {ds_dir}; resume=true continues it")
                    if run is not None:
                        run.finish(exit_code=130)
                    raise KeyboardInterrupt
                batch = collate([train_set[i] for i in idx], pad)
                if features is None:
                    teacher = teacher_pass(staged, batch, draft, layers)
                else:
                    cached = features.hidden(idx, batch["input_ids"].shape[1], staged.device)
                    teacher = teacher_targets(staged, cached, batch, draft)
                hidden = {k: v.to(PRECISION[cfg.deepspeed.precision]) for k, v in teacher.hidden.items()}
                loss, top1, hits = objective.step(engine, hidden, teacher, batch["valid"].to(staged.device), occ_gen)
                engine.backward(loss)
                if engine.is_gradient_accumulation_boundary():
                    grad_norms = gradient_norms(module)
                engine.step()
                losses.append(float(loss.detach()))
                agree.append(top1)
                for key, values in hits.items():
                    groups.setdefault(key, []).extend(values)
                tokens += int(batch["valid"].sum())
                tokens_seen += int(batch["valid"].sum()) * world
                excluded += teacher.excluded
            seconds = time.perf_counter() - t0
            metrics = {"train/loss": sum(losses) / len(losses), "train/top1": float(torch.cat(agree).mean()),
                       "lr": scheduler.get_last_lr()[0], **grad_norms,
                       "tokens_per_s": tokens * world / seconds, "train/excluded_positions": excluded,
                       "train/tokens_seen": tokens_seen}
            metrics.update({key: sum(v) / len(v) for key, v in sorted(groups.items()) if v})
            last = step + 1 == cfg.optim.steps
            if rank == 0 and ((cfg.eval_every and (step + 1) % cfg.eval_every == 0) or last):
                metrics.update(objective.evaluate(module, staged, loaded.tokenizer, held, held_convs, draft))
            if rank == 0:
                with open(os.path.join(out_dir, METRICS_FILE), "a") as f:  # plain-text twin of the W&B history
                    f.write(json.dumps({"step": step + 1, **metrics}) + "\n")
                bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", top1=f"{metrics['train/top1']:.3f}")
                if run is not None and ((step + 1) % cfg.log_every == 0 or last):
                    run.log(metrics, step=step + 1)
            summary = metrics
            stopping = stop.agreed(world)
            if (cfg.save_every and (step + 1) % cfg.save_every == 0) or last or stopping:
                save(step + 1, tokens_seen)
            if stopping:
                log(f"stopped: saved step {step + 1} in {ds_dir}; resume=true continues it")
                if run is not None:
                    run.finish(exit_code=130)
                raise KeyboardInterrupt  # the entry point prints one line and exits 130; resume=true continues
    if run is not None:
        run.summary.update(summary)
        run.finish()
    return summary
