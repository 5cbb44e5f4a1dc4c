"""Load a target for decoding or training: the default SmolLM2, a .gguf file, an HF directory, or a tiny random
model (`tiny-llama`, ...). Real targets load from the safetensors weight cache, written on first use."""

from __future__ import annotations

import torch

from spd.targets.loaded import LoadedTarget, read_source, weights_fingerprint  # noqa: F401  (re-exported)
from spd.targets.source import DEFAULT_TARGET, resolve_source
from spd.targets.weight_cache import load_parts, materialize


def load_target(spec: str = DEFAULT_TARGET, dtype: torch.dtype = torch.float32, device: str = "cpu",
                weights: str = "float32") -> LoadedTarget:
    """`spec` is "smollm2", a directory with config.json, a .gguf file path, or tiny-<family>. weights="q4": a GGUF
    target's products from the file's own 4- and 8-bit blocks (spd.targets.blocks)."""
    if spec.startswith("tiny-"):  # built in memory in an instant: nothing to cache (and no blocks: weights=q4 is
        # refused for it before anything loads)
        loaded = read_source(resolve_source(spec), dtype)
        loaded.model.to(device)
        return loaded
    return load_parts(materialize(spec, dtype), None, embed=True, head=True, dtype=dtype, device=device,
                      weights=weights)
