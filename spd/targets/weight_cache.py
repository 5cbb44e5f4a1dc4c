"""A target's weights as a verified safetensors directory, written once per (source content, dtype), from which any
process loads what it runs: the whole model (`spd.targets.loading.load_target`) or one pipeline stage's layers.

The cache lives under $SPD_CACHE_DIR (default ~/.cache/spd)/targets/<key>; the key hashes the name, the content of
every source file and the dtype. It is written into a temporary sibling and renamed, so a half-written cache is
never seen; `spd_target.json` records the target's name and weight fingerprint (checkpoints compare it) and the
size and xxh3-128 digest of the weights file, checked on every load: a damaged cache is rebuilt, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile

import torch
import xxhash
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.initialization import no_init_weights

from spd.errors import UserError
from spd.targets import blocks
from spd.targets.loaded import LoadedTarget, note_language_model, read_source
from spd.targets.source import Source, resolve_source

FORMAT = 2
META_FILE, WEIGHTS_FILE, CONFIG_FILE = "spd_target.json", "model.safetensors", "config.json"


def cache_root() -> str:
    return os.environ.get("SPD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "spd")


def write_json_atomic(path: str, payload: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def file_digest(path: str) -> str:
    """sha256 of a file's content, remembered per (path, size, mtime, inode) so an unchanged file is hashed once."""
    st = os.stat(path)
    stamp = [os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino]
    memo = os.path.join(cache_root(), "sources", hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:24] + ".json")
    try:
        with open(memo) as f:
            return json.load(f)["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        write_json_atomic(memo, {"stamp": stamp, "sha256": digest})
    except OSError:
        pass  # an unwritable cache only costs the hash next time; materialize reports it if it matters
    return digest


def cache_key(source: Source, dtype: torch.dtype) -> str:
    contents = [[os.path.basename(p), file_digest(p)] for p in source.files]
    payload = {"format": FORMAT, "name": source.name, "files": contents, "dtype": str(dtype)}
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


def _weights_digest(path: str) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def damage(path: str) -> str | None:
    """None if the cache at `path` is complete and intact, else what is wrong with it."""
    try:
        with open(os.path.join(path, META_FILE)) as f:
            meta = json.load(f)
        weights = meta["weights"]
    except FileNotFoundError:
        return f"{META_FILE} is missing"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{META_FILE} is unreadable ({type(exc).__name__})"
    if meta.get("format") != FORMAT:
        return f"format {meta.get('format')} is not {FORMAT}"
    for name in [CONFIG_FILE, WEIGHTS_FILE, *meta.get("tokenizer_files", [])]:
        if not os.path.isfile(os.path.join(path, name)):
            return f"{name} is missing"
    file = os.path.join(path, WEIGHTS_FILE)
    if os.path.getsize(file) != weights["size"]:
        return f"{WEIGHTS_FILE} has {os.path.getsize(file)} bytes, not {weights['size']}"
    if _weights_digest(file) != weights["xxh3_128"]:
        return f"{WEIGHTS_FILE} does not match its recorded digest"
    return None


def materialize(spec: str, dtype: torch.dtype = torch.float32) -> str:
    """The verified cache directory of `spec` in `dtype`, written from the source the first time (and again if the
    copy on disk is damaged)."""
    source = resolve_source(spec)
    note_language_model(source)
    parent = os.path.join(cache_root(), "targets")
    path = os.path.join(parent, cache_key(source, dtype))
    if os.path.isdir(path):
        problem = damage(path)
        if problem is None:
            return path
        print(f"[spd] the weight cache {path} is damaged ({problem}); rebuilding it", file=sys.stderr)
        _discard(path)
    elif sys.stderr.isatty():
        print(f"[spd] reading {source.name} once into a safetensors cache under {parent}", file=sys.stderr)
    loaded = read_source(source, dtype)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-target-", dir=parent)
    except OSError as exc:
        raise UserError(f"cannot write the target cache under {parent!r} ({exc.strerror}); set SPD_CACHE_DIR "
                        "to a writable directory") from None
    try:
        _write(loaded, tmp, spec, dtype)
        try:
            os.rename(tmp, path)
        except OSError:  # another process wrote the same cache first: theirs is as good
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _write(loaded: LoadedTarget, directory: str, spec: str, dtype: torch.dtype) -> None:
    # save_file, not save_pretrained: a GGUF-loaded model refuses to serialise; tied tensors are stored once.
    state, seen = {}, set()
    for name, tensor in loaded.model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            state[name] = tensor.detach().contiguous()
    weights = os.path.join(directory, WEIGHTS_FILE)
    save_file(state, weights, metadata={"format": "pt"})
    loaded.model.config.save_pretrained(directory)
    tokenizer_files = []
    if loaded.tokenizer is not None:
        tokenizer_files = [os.path.basename(p) for p in loaded.tokenizer.save_pretrained(directory)
                           if os.path.dirname(os.path.abspath(p)) == os.path.abspath(directory)]
    meta = {"format": FORMAT, "spec": spec, "name": loaded.name, "fingerprint": loaded.fingerprint,
            "dtype": str(dtype), "tokenizer_files": sorted(set(tokenizer_files)),
            "weights": {"size": os.path.getsize(weights), "xxh3_128": _weights_digest(weights)}}
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump(meta, f)


def _discard(path: str) -> None:
    trash = tempfile.mkdtemp(prefix=".tmp-damaged-", dir=os.path.dirname(path))
    os.rename(path, os.path.join(trash, "cache"))  # out of the way at once; then deleted
    shutil.rmtree(trash, ignore_errors=True)


def ensure_blocks(path: str) -> None:
    """The cache at `path` with its GGUF source's 4- and 8-bit blocks beside the float32 weights (spd.targets.blocks),
    read from the source the first time `weights=q4` asks for them."""
    if os.path.isfile(os.path.join(path, blocks.BLOCKS_FILE)):
        return
    with open(os.path.join(path, META_FILE)) as f:
        meta = json.load(f)
    source = resolve_source(meta["spec"])
    if not source.gguf_file or meta["dtype"] != str(torch.float32):
        raise UserError(f"weights=q4 multiplies a GGUF file's own blocks; target {source.name!r} in {meta['dtype']} "
                        "has none: use weights=float32, or a .gguf target in float32")
    whole = load_parts(path, None, embed=True, head=True, dtype=torch.float32)
    blocks.write_blocks(os.path.join(source.directory, source.gguf_file), whole.model, path)


def load_parts(path: str, layers: range | None, embed: bool, head: bool, dtype: torch.dtype,
               device: str | torch.device = "cpu", weights: str = "float32") -> LoadedTarget:
    """The target's module tree with only these parameters materialised (the rest stay on the meta device, so
    running them fails loudly): decoder `layers` (None: all), the embedding, and the final norm + LM head.
    weights="q4": the Linears of a GGUF target multiply from the file's own blocks (spd.targets.blocks), their
    float32 weights left on meta (a tied head's are its embedding's, loaded)."""
    if weights == "q4":
        ensure_blocks(path)
    with open(os.path.join(path, META_FILE)) as f:
        meta = json.load(f)
    config = AutoConfig.from_pretrained(path)
    # Parameters on meta, filled below; rotary tables etc. are real. No initialisation: every weight is loaded.
    with init_empty_weights(include_buffers=False), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if layers is None:
        layers = range(config.num_hidden_layers)
    prefixes = [f"model.layers.{i}." for i in layers]
    if embed:
        prefixes.append("model.embed_tokens.")
    if head:
        prefixes += ["model.norm.", "lm_head."]
    # weights="q4": a Linear multiplied from blocks never reads its float32 weight, so it stays on meta (~4x less
    # memory; anything that would read it fails loudly) — but the embedding's rows are read, tied head or not
    def wanted(name: str) -> bool:
        return any(name.startswith(p) for p in prefixes)
    embedding = model.get_input_embeddings().weight
    from_blocks = {id(module.weight) for module, _ in blocks.blocked(model, path, wanted)
                   if module.weight is not embedding} if weights == "q4" else set()
    try:
        with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt", device="cpu") as f:
            stored = set(f.keys())
            for name, param in list(model.named_parameters(remove_duplicate=False)):
                if not wanted(name) or id(param) in from_blocks:
                    continue
                source = name if name in stored else "model.embed_tokens.weight"  # a tied head is stored once
                # copy=True: aligned memory, so the kernels (and the results) match a load from the source
                set_module_tensor_to_device(model, name, device, value=f.get_tensor(source).to(dtype=dtype, copy=True))
    except SafetensorError as exc:
        raise UserError(f"the weight cache {path} is unreadable ({exc}); delete it and run again") from None
    if embed and head and getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight  # one copy, as in the full model
    for module in model.modules():  # buffers (rotary tables) follow the parameters
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type != "meta":
                module._buffers[name] = buffer.to(device)
    model.eval().requires_grad_(False)
    if weights == "q4":           # after the tie: a tied head's blocks are its embedding's
        blocks.attach(blocks.blocked(model, path, wanted), path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    return LoadedTarget(model=model, tokenizer=tokenizer, name=meta["name"], fingerprint=meta["fingerprint"])
