"""Structured configs (OmegaConf): dataclass defaults <- YAML file <- `key=value` overrides; unknown keys are errors."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from spd.errors import UserError


@dataclass
class WandbSection:
    mode: str = "offline"               # offline | online | disabled (never a login call in code)
    project: str = "spd"
    name: Optional[str] = None


@dataclass
class GenerateConfig:
    target: str = "smollm2"              # "smollm2", an HF model directory, or a .gguf file
    checkpoint: Optional[str] = None     # trained module directory; None = randomly initialised module
    prompt: Optional[str] = None
    chat_template: bool = True           # wrap the prompt as a user turn with the generation prompt
    method: str = "spd"                  # spd | ar (plain autoregressive through the same stage runner)
    n: Optional[int] = None              # pipeline stages; None = the checkpoint's n, else 5
    stage_bounds: Any = None             # explicit inner boundaries b_1..b_{n-1}, or "balanced" (by measured cost)
    module_layers: int = 1               # L_s of a randomly initialised module
    module_cache: bool = True            # cache K/V of depth-n memory rows (exact: they never change)
    max_new_tokens: int = 128
    temperature: float = 0.0             # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    json: bool = False                   # print one JSON object instead of text + a stats line
    runtime: str = "local"               # local (stages one after another, the reference) | distributed
    threads_per_stage: Optional[int] = None  # distributed: intra-op threads per process (None: cores // (n + 1))
    master_addr: str = "127.0.0.1"       # distributed: where the controller hosts the rendezvous
    master_port: int = 0                 # distributed: 0 = any free port
    timeout_s: float = 20.0              # distributed: longest wait for any message inside a generation


def load_config(schema: type, path: str | None, overrides: list[str]):
    """Merge schema defaults, an optional YAML file and dotlist overrides; return a typed, read-only config."""
    base = OmegaConf.structured(schema)
    try:
        layers = [base]
        if path is not None:
            if not os.path.isfile(path):
                raise UserError(f"config file {path!r} does not exist")
            layers.append(OmegaConf.load(path))
        bad = [item for item in overrides if "=" not in item]
        if bad:
            raise UserError(f"override {bad[0]!r} is not key=value (e.g. n=5)")
        layers.append(OmegaConf.from_dotlist(overrides))
        cfg = OmegaConf.merge(*layers)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        first = str(exc).splitlines()[0]
        if "not in struct" in first or "Key '" in first and "not" in first:
            raise UserError(f"unknown config key {key!r}; valid keys: {', '.join(base.keys())}") from None
        raise UserError(f"bad value for config key {key!r}: {first}") from None
    OmegaConf.set_readonly(cfg, True)
    return cfg


def to_yaml(cfg) -> str:
    return OmegaConf.to_yaml(cfg)
