"""Preflight of the directories a command will write, run before any model, data or process group is touched,
so that a refused run leaves nothing behind. It creates nothing itself."""

from __future__ import annotations

import json
import os
import shutil

from spd.errors import UserError

RANDOM = "random"   # checkpoint=random: an untrained module

MIN_FREE_BYTES = 64 << 20  # outputs, checkpoints and caches of the default target all fit in far more than this


def cache_root() -> str:
    """Where the suite keeps what it computes once and reuses: $SPD_CACHE_DIR, default ~/.cache/spd — the verified
    target weights (targets/, spd.targets.weight_cache, whose cache_root is this same rule), datastores, row costs,
    and eval's greedy traces (traces/). Torch-free: configs read it for their defaults."""
    return os.environ.get("SPD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "spd")


def default_trace_cache_dir() -> str:
    """eval's trace cache, beside the target weights cache: <cache_root>/traces (read when a config is made, so a
    changed SPD_CACHE_DIR applies to the next run)."""
    return os.path.join(cache_root(), "traces")


def check_writable_dir(path: str, key: str, need_bytes: int = MIN_FREE_BYTES) -> None:
    """`path` names a directory this run may create or write into: not a file, below an existing directory we may
    write to, on a disk with room."""
    if not path or not path.strip():
        raise UserError(f"{key} is empty; give a directory")
    absolute = os.path.abspath(path)
    if os.path.exists(absolute) and not os.path.isdir(absolute):
        raise UserError(f"{key}={path!r} is a file; give a directory")
    probe = absolute
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UserError(f"{key}={path!r} cannot be created: {probe!r} is a file; give another directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{key}={path!r} is not writable; choose a directory you can write to")
    free = shutil.disk_usage(probe).free
    if free < need_bytes:
        raise UserError(f"{key}={path!r}: {free >> 20} MiB free on that disk, {need_bytes >> 20} MiB needed; free some "
                        "space or choose another disk")


def is_empty_dir(path: str) -> bool:
    return not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path))


def read_run_config(path: str, fix: str) -> dict:
    """The config.json a run left in its directory, or a UserError (a torn file is a crash's, not a bug)."""
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        raise UserError(f"{path} is unreadable (half-written?); {fix}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a run's config; {fix}")
    return config


AUTHORS_HEAD = "speculation_head_final.pt"   # how the SPD authors publish their heads


def refuse_authors_head(path: str) -> None:
    """The SPD authors' heads (a .pt of a state dict and a config) are not this suite's module: say so, not "no
    config.json"."""
    head = path if path.endswith(".pt") else os.path.join(path, AUTHORS_HEAD)
    if os.path.isfile(head) and not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"{head} is an SPD authors' head; its per-depth feature sets and layers that run every row are "
                        "not this suite's module (docs/training.md, \"Sharing heads\"), so it cannot be read")


def check_checkpoint_dir(checkpoint: str | None, method: str | None = None) -> None:
    """A checkpoint= that names a directory names one that exists and holds a module's config.json: checked from
    the config alone, before torch loads (spd.models.checkpoint reads and verifies the rest once the target is loaded).
    None (the shipped module) and `random` (untrained) name none; a method that loads no module (the lookup, PipeDec)
    is left to the session, which refuses checkpoint= itself (drop it)."""
    from spd.methods import AR, METHODS

    if checkpoint is None or checkpoint == RANDOM:
        return
    if method is not None and METHODS[method].decoder != AR and not METHODS[method].trained:
        return
    refuse_authors_head(checkpoint)
    if not os.path.isdir(checkpoint):
        raise UserError(f"checkpoint directory {checkpoint!r} does not exist; pass checkpoint=<dir> of a trained "
                        "module")
    if not os.path.isfile(os.path.join(checkpoint, "config.json")):   # spd.models.checkpoint.CONFIG_FILE
        raise UserError(f"checkpoint {checkpoint!r} has no config.json; it is not a module checkpoint")
