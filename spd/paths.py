"""Preflight of the directories a command will write, run before any model, data or process group is touched,
so that a refused run leaves nothing behind. It creates nothing itself."""

from __future__ import annotations

import json
import os
import shutil

from spd.errors import UserError

MIN_FREE_BYTES = 64 << 20  # outputs, checkpoints and caches of the default target all fit in far more than this


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
