"""A target's weights as a safetensors directory, written once, from which any process loads only the parts it
runs (a pipeline stage its own layers, the controller the embedding): never a whole copy per process.

The cache lives under $SPD_CACHE_DIR (default ~/.cache/spd)/targets/<key>, the key hashing the target spec and
its source files; it is written into a temporary sibling and renamed, so a half-written cache is never seen.
`spd_target.json` there records the name and the weight fingerprint of the full target (checkpoints compare it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from spd.errors import UserError
from spd.target.loading import DEFAULT_TARGET, LoadedTarget, load_target

META_FILE, WEIGHTS_FILE = "spd_target.json", "model.safetensors"


def cache_root() -> str:
    return os.environ.get("SPD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "spd")


def _source_files(spec: str) -> list[str]:
    if spec.startswith("tiny-"):
        return []
    if spec in (DEFAULT_TARGET, "SmolLM2-135M-Instruct"):
        from spd.target.loading import _smollm2_location

        directory, name = _smollm2_location()
        return [os.path.join(directory, name)]
    if os.path.isfile(spec):
        return [spec]
    return sorted(os.path.join(spec, f) for f in os.listdir(spec) if os.path.isfile(os.path.join(spec, f)))


def cache_key(spec: str) -> str:
    """Target spec + name, size and modification time of each source file (hashing GBs on every call is not cheap)."""
    digest = hashlib.sha256(spec.encode())
    for path in _source_files(spec):
        st = os.stat(path)
        digest.update(f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def materialize(spec: str) -> str:
    """The cache directory of `spec`, written from a full load the first time (float32, as the source gives it)."""
    path = os.path.join(cache_root(), "targets", cache_key(spec))
    if os.path.isfile(os.path.join(path, META_FILE)):
        return path
    loaded = load_target(spec, torch.float32, "cpu")
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-target-", dir=parent)
    except OSError as exc:
        raise UserError(f"cannot write the target cache under {parent!r} ({exc.strerror}); set SPD_CACHE_DIR "
                        "to a writable directory") from None
    try:
        # save_file, not save_pretrained: a GGUF-loaded model refuses to serialise; tied tensors are stored once.
        state, seen = {}, set()
        for name, tensor in loaded.model.state_dict().items():
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                state[name] = tensor.detach().contiguous()
        save_file(state, os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
        loaded.model.config.save_pretrained(tmp)
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump({"spec": spec, "name": loaded.name, "fingerprint": loaded.fingerprint}, f)
        try:
            os.rename(tmp, path)
        except OSError:  # another process wrote the same cache first: theirs is as good
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def load_parts(path: str, layers: range, embed: bool, head: bool, dtype: torch.dtype,
               device: str | torch.device = "cpu") -> LoadedTarget:
    """The target's module tree with only these parameters materialised (the rest stay on the meta device, so
    running them fails loudly): decoder `layers`, the embedding, and the final norm + LM head."""
    with open(os.path.join(path, META_FILE)) as f:
        meta = json.load(f)
    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):  # rotary tables etc. are real; parameters are not
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    prefixes = [f"model.layers.{i}." for i in layers]
    if embed:
        prefixes.append("model.embed_tokens.")
    if head:
        prefixes += ["model.norm.", "lm_head."]
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt", device="cpu") as f:
        stored = set(f.keys())
        for name, _ in list(model.named_parameters(remove_duplicate=False)):
            if not any(name.startswith(p) for p in prefixes):
                continue
            source = name if name in stored else "model.embed_tokens.weight"  # a tied head is stored once
            set_module_tensor_to_device(model, name, device, value=f.get_tensor(source).to(dtype=dtype, copy=True))  # aligned: same kernels as a full load
    if embed and head and getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight  # one copy, as in the full model
    model.eval().requires_grad_(False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    return LoadedTarget(model=model, tokenizer=tokenizer, name=meta["name"], fingerprint=meta["fingerprint"])
