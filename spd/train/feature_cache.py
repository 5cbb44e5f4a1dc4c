"""Teacher-feature cache: the hidden states the features need, computed once per (target, data, layout) and
reused across epochs and configurations, so later epochs drop the teacher forward (most of a step's time).

Layout on disk: <dir>/<key>/meta.json, offsets.npy and one `layer_<l>.npy` memmap [total_tokens, d] per stored
layer. The key hashes the target's weight fingerprint, the stage bounds, the stored dtype and every training
example's token ids, so any change to the target, the data, the template, the filters or the layout makes a new
entry. The teacher's distribution is recomputed from the cached H^L (final norm + head at loss positions only).

H^l does not depend on how the target is split, so an entry that stores more layers than a run needs (built with
`extra_layers`, e.g. the union over n = 3, 8 and EAGLE-3's fused layers) serves every run on the same target, data
and dtype: one teacher pass for a whole comparison.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import torch
from tqdm import tqdm

from spd.layout import needed_layers
from spd.targets.stages import StagedTarget

DTYPES = {"float16": np.float16, "float32": np.float32}


def cache_key(fingerprint: str, bounds: list[int], dtype: str, examples: list[dict],
              layers: list[int] | None = None) -> str:
    """layers: stored layers when they are not the pipeline's own (EAGLE-3's); the default keeps older keys."""
    identity = [fingerprint, bounds, dtype]
    if layers is not None and sorted(layers) != needed_layers(bounds):
        identity.append(sorted(layers))
    digest = hashlib.sha256(json.dumps(identity).encode())
    _hash_examples(digest, examples)
    return digest.hexdigest()[:20]


def examples_digest(examples: list[dict]) -> str:
    """The training data alone (what a shared entry must match besides target and dtype)."""
    digest = hashlib.sha256()
    _hash_examples(digest, examples)
    return digest.hexdigest()[:20]


def _hash_examples(digest, examples: list[dict]) -> None:
    for ex in examples:
        digest.update(np.asarray(ex["input_ids"], dtype=np.int64).tobytes())
        digest.update(b"|")


class FeatureCache:
    """One entry, opened for `layers` (default: every layer it stores)."""

    def __init__(self, path: str, layers: list[int] | None = None):
        with open(os.path.join(path, "meta.json")) as f:
            self.meta = json.load(f)
        self.path = path
        self.offsets = np.load(os.path.join(path, "offsets.npy"))
        wanted = self.meta["layers"] if layers is None else sorted(layers)
        self.layers = {int(l): np.load(os.path.join(path, f"layer_{l}.npy"), mmap_mode="r") for l in wanted}

    def hidden(self, indices: list[int], width: int, device) -> dict[int, torch.Tensor]:
        """{layer: [B, width, d]} float32 for the given examples, right-padded with zeros."""
        out = {}
        for layer, array in self.layers.items():
            block = np.zeros((len(indices), width, array.shape[1]), dtype=np.float32)
            for b, i in enumerate(indices):
                lo, hi = self.offsets[i], self.offsets[i + 1]
                block[b, : hi - lo] = array[lo:hi]
            out[layer] = torch.from_numpy(block).to(device)
        return out


def find_shared(root: str, fingerprint: str, dtype: str, data: str, layers: list[int]) -> str | None:
    """An entry on the same target, dtype and data that stores every layer in `layers`, if one exists."""
    if not os.path.isdir(root):
        return None
    for name in sorted(os.listdir(root)):
        meta_path = os.path.join(root, name, "meta.json")
        if not os.path.isfile(meta_path):
            continue
        with open(meta_path) as f:
            meta = json.load(f)
        if (meta.get("examples_digest") == data and meta["fingerprint"] == fingerprint and meta["dtype"] == dtype
                and set(layers) <= set(meta["layers"])):
            return os.path.join(root, name)
    return None


@torch.no_grad()
def build_or_load(staged: StagedTarget, fingerprint: str, examples: list[dict], root: str, dtype: str,
                  log=print, layers: list[int] | None = None, extra_layers: list[int] = ()) -> FeatureCache:
    """layers: which H^l the run reads (default: every layer the pipeline's features read, H^L included);
    extra_layers: stored as well when the entry is written, for later runs to share."""
    if dtype not in DTYPES:
        raise ValueError(f"teacher cache dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    layers = sorted(layers) if layers is not None else needed_layers(staged.bounds)
    bad = [l for l in extra_layers if not 0 <= l <= staged.num_layers]
    if bad:
        raise ValueError(f"teacher cache layers {bad} are outside 0..{staged.num_layers}")
    stored = sorted({*layers, *extra_layers})
    key = cache_key(fingerprint, staged.bounds, dtype, examples, stored)
    path = os.path.join(root, key)
    data = examples_digest(examples)
    if not os.path.isfile(os.path.join(path, "meta.json")):
        path = find_shared(root, fingerprint, dtype, data, layers) or path
    if os.path.isfile(os.path.join(path, "meta.json")):
        log(f"teacher-feature cache hit: {path}")
        return FeatureCache(path, layers)
    needed, layers = layers, stored
    lengths = [len(ex["input_ids"]) for ex in examples]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    d = staged.config.hidden_size
    size = int(offsets[-1]) * len(layers) * d * np.dtype(DTYPES[dtype]).itemsize
    log(f"writing teacher-feature cache: {offsets[-1]} tokens x {len(layers)} layers x {d} ({dtype}) = "
        f"{size / 2**30:.2f} GiB -> {path}")
    os.makedirs(root, exist_ok=True)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    arrays = {l: np.lib.format.open_memmap(os.path.join(tmp, f"layer_{l}.npy"), mode="w+", dtype=DTYPES[dtype],
                                           shape=(int(offsets[-1]), d)) for l in layers}
    for i, ex in enumerate(tqdm(examples, desc="teacher features")):
        ids = torch.tensor([ex["input_ids"]], device=staged.device)
        _, hidden = staged.forward_all(ids, cache=None, capture=frozenset(layers))
        for l in layers:
            arrays[l][offsets[i]: offsets[i + 1]] = hidden[l][0].float().cpu().numpy()
    for array in arrays.values():
        array.flush()
    np.save(os.path.join(tmp, "offsets.npy"), offsets)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({"fingerprint": fingerprint, "bounds": staged.bounds, "layers": layers, "dtype": dtype,
                   "examples": len(examples), "tokens": int(offsets[-1]), "examples_digest": data}, f)
    os.replace(tmp, path)
    return FeatureCache(path, needed)
