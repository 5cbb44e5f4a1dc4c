"""Trained speculation modules that ship inside the package, and which one a decoding run gets by default.

`spd-infer generate` / `chat` / `eval` on the default target with no `checkpoint=` draft with the shipped module
whose n and stage bounds match the run (so a first command shows real acceptance); `checkpoint=random` asks for
an untrained module, any other value is a checkpoint directory. Torch-free: resolving happens before loading.
"""

from __future__ import annotations

import os

from spd.paths import RANDOM, read_run_config  # noqa: F401 (RANDOM: read here by the session and CLI)
from spd.targets.source import DEFAULT_TARGET

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "modules")
DEFAULT_N = 5       # the pipeline a run without n= (and without a checkpoint that has one) gets


def shipped_modules() -> list[dict]:
    """config.json of every shipped module, with its directory under "path"."""
    out = []
    if not os.path.isdir(SHIPPED_DIR):
        return out
    for name in sorted(os.listdir(SHIPPED_DIR)):
        config = os.path.join(SHIPPED_DIR, name, "config.json")
        if os.path.isfile(config):
            fix = "reinstall the package, or pass checkpoint=random"
            out.append({**read_run_config(config, fix), "path": os.path.join(SHIPPED_DIR, name)})
    return out


def checkpoint_for(checkpoint: str | None, target: str, n: int | None, stage_bounds,
                   method: str | None = None) -> str | None:
    """The module directory a run drafts with, or None for an untrained module.

    The default applies to the default target only, and only where a shipped module was trained as the requested
    drafter (SPD if none is given), for the requested n (DEFAULT_N's first, then any, if n is not given) and stage
    bounds (the module's own, if none are given)."""
    if checkpoint == RANDOM:
        return None
    if checkpoint is not None:
        return checkpoint
    if target != DEFAULT_TARGET:
        return None
    for module in sorted(shipped_modules(), key=lambda m: m["n"] != DEFAULT_N):
        inner = module["stage_bounds"][1:-1]
        if module.get("method", "spd") != (method or "spd"):
            continue
        if n is not None and n != module["n"]:
            continue
        if stage_bounds is not None and (isinstance(stage_bounds, str) or list(stage_bounds) != inner):
            continue
        return module["path"]
    return None
