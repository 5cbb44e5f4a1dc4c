"""A loaded target and its identity: the weight fingerprint that checkpoints and caches compare."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from spd.errors import UserError
from spd.targets import DTYPE_NAMES
from spd.targets.source import Source


@dataclass
class LoadedTarget:
    model: PreTrainedModel
    tokenizer: object | None
    name: str          # what identifies the target to a human (file or directory name)
    fingerprint: str   # hash of the weights, stored in checkpoints to refuse foreign targets


def weights_fingerprint(model: torch.nn.Module, as_dtype: torch.dtype | None = None) -> str:
    """Cheap but weight-sensitive: shapes plus the first 4096 values of every parameter, hashed. as_dtype: the
    fingerprint the same weights have when loaded in that dtype (each value rounded to it first)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)[:4096]
        if as_dtype is not None and flat.is_floating_point():
            flat = flat.to(as_dtype)
        flat = flat.to(torch.float32).cpu().contiguous()
        digest.update(name.encode())
        digest.update(json.dumps(list(tensor.shape)).encode())
        digest.update(flat.numpy().tobytes())
    return digest.hexdigest()[:16]


# the dtypes a target may be loaded in (`dtype=`), by name
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
REDUCED = {name: dtype for name, dtype in DTYPES.items() if name != "float32"}


def reduced_fingerprints(model: torch.nn.Module) -> dict[str, str]:
    """{dtype: fingerprint} of a float32 target's weights as a bfloat16 / float16 load of the same source gives them
    (a source is read in float32 and cast once, so the rounding is the same): a module trained on the float32
    target is recognised when it drafts for a reduced-precision one. Empty for a target not in float32."""
    if next(model.parameters()).dtype != torch.float32:
        return {}
    return {name: weights_fingerprint(model, dtype) for name, dtype in REDUCED.items()}


def note_language_model(source: Source) -> None:
    """A multimodal checkpoint (Qwen3.5's released layout) is decoded as its language model: say so."""
    if not source.directory or source.gguf_file:
        return
    with open(os.path.join(source.directory, "config.json")) as f:
        config = json.load(f)
    if "text_config" in config and "vision_config" in config:
        kind = (config.get("architectures") or ["a multimodal model"])[0]
        print(f"target {source.name!r}: {kind} checkpoint; its language model decodes, the vision tower is not "
              "loaded", file=sys.stderr)


def read_source(source: Source, dtype: torch.dtype) -> LoadedTarget:
    """The whole target from its source files, on the CPU (slow for GGUF: every tensor is de-quantised)."""
    if source.name.startswith("tiny-"):  # seeded, so every process builds the same weights
        from spd.targets.tiny import tiny_target

        model, tokenizer = tiny_target(source.name[5:])
        model.to(dtype=dtype).eval().requires_grad_(False)
        return LoadedTarget(model, tokenizer, source.name, weights_fingerprint(model))
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=dtype, **kwargs)
    except (OSError, ValueError) as exc:
        raise UserError(f"could not load target {source.name!r}: {str(exc).splitlines()[0]}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.directory, **kwargs)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # tiny test models may come without one; callers needing text say so
    model.eval().requires_grad_(False)
    return LoadedTarget(model=model, tokenizer=tokenizer, name=source.name, fingerprint=weights_fingerprint(model))
