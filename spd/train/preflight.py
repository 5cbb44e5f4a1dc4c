"""The trainer's checks of its output_dir, run from the config alone — before torch, DeepSpeed, the target or the
data load — so a run that cannot start (or cannot resume) is refused at once, with what to pass instead.

output_dir is one of: new or empty (a fresh run); a run's folder (config.json) holding a resumable DeepSpeed state
(ds_state/latest and the step it names: resume=true continues it); a run's folder without one (it stopped before
its first save: overwrite=true starts afresh there); or someone else's files (never deleted: choose another)."""

from __future__ import annotations

import os

from omegaconf import OmegaConf

from spd.errors import UserError
from spd.paths import check_writable_dir, is_empty_dir, read_run_config

RUN_CONFIG = "config.json"
DS_STATE = "ds_state"          # DeepSpeed's checkpoint directory inside output_dir
LATEST = "latest"              # DeepSpeed's file naming the tag (step<N>) load_checkpoint reads


def run_config_path(out_dir: str) -> str:
    return os.path.join(out_dir, RUN_CONFIG)


def saved_tag(out_dir: str) -> str | None:
    """The DeepSpeed tag (e.g. "step12") a resume would load, or None where the run saved no complete state:
    DeepSpeed writes `latest` only once the tag's directory is written."""
    ds_dir = os.path.join(out_dir, DS_STATE)
    try:
        with open(os.path.join(ds_dir, LATEST)) as f:
            tag = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return tag if tag and os.path.isdir(os.path.join(ds_dir, tag)) else None


def check_resumable(cfg, resolved: dict | None = None) -> None:
    """resume=true: output_dir holds this config's run and a DeepSpeed state to continue from."""
    out = cfg.output_dir
    if not os.path.isfile(run_config_path(out)):
        raise UserError(f"resume=true but {out!r} holds no run (no config.json); drop resume or fix output_dir")
    previous = read_run_config(run_config_path(out), "start afresh with overwrite=true")
    resolved = OmegaConf.to_container(cfg, resolve=True) if resolved is None else resolved
    ignore = ("resume", "overwrite")
    if {k: v for k, v in previous.items() if k not in ignore} != {k: v for k, v in resolved.items() if k not in ignore}:
        raise UserError(f"{out!r} was written by a different config; resume with the same config or use a new "
                        "output_dir")
    if saved_tag(out) is None:
        raise UserError(f"resume=true but {out!r} holds no resumable state (its run stopped before it saved "
                        f"{DS_STATE}/); pass overwrite=true instead of resume=true to start afresh there")


def check_paths(cfg) -> None:
    """Every directory this run writes is writable, and output_dir is new, empty, this run's own with a state to
    resume (resume=true), or a run's folder given up (overwrite=true)."""
    check_writable_dir(cfg.output_dir, "output_dir")
    if cfg.teacher_cache:
        check_writable_dir(cfg.teacher_cache_dir, "teacher_cache_dir")
    if cfg.data.regenerate:
        check_writable_dir(cfg.data.regenerated_dir, "data.regenerated_dir")
    out = cfg.output_dir
    if cfg.resume:
        check_resumable(cfg)
        return
    if is_empty_dir(out):
        return
    if not os.path.isfile(run_config_path(out)):   # not a run's folder: overwrite=true would delete someone's files
        raise UserError(f"output_dir={out!r} is not empty and holds no training run (no config.json); choose a new "
                        "output_dir, or empty that one")
    if cfg.overwrite:
        return
    tag = saved_tag(out)
    if tag is None:
        raise UserError(f"output_dir={out!r} holds a run that saved no resumable state (it stopped before its first "
                        "save); pass overwrite=true to start afresh there, or choose a new output_dir")
    raise UserError(f"output_dir={out!r} holds a run saved at {tag.replace('step', 'step ')}; pass resume=true to "
                    "continue it, overwrite=true to replace it, or choose a new output_dir")
