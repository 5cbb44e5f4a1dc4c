"""Teacher-feature cache: the hidden states the features need, computed once per (target, data, layout) and
reused across epochs and configurations, so later epochs drop the teacher forward (most of a step's time).

Layout on disk: <dir>/<key>/meta.json, offsets.npy and one `layer_<l>.npy` memmap [total_tokens, d] per needed
layer. The key hashes the target's weight fingerprint, the stage bounds, the stored dtype and every training
example's token ids, so any change to the target, the data, the template, the filters or the layout makes a new
entry. The teacher's distribution is recomputed from the cached H^L (final norm + head at loss positions only).
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
from spd.target.stages import StagedTarget

DTYPES = {"float16": np.float16, "float32": np.float32}


def cache_key(fingerprint: str, bounds: list[int], dtype: str, examples: list[dict],
              layers: list[int] | None = None) -> str:
    """layers: stored layers when they are not the pipeline's own (EAGLE-3's); the default keeps older keys."""
    identity = [fingerprint, bounds, dtype]
    if layers is not None and list(layers) != needed_layers(bounds):
        identity.append(sorted(layers))
    digest = hashlib.sha256(json.dumps(identity).encode())
    for ex in examples:
        digest.update(np.asarray(ex["input_ids"], dtype=np.int64).tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:20]


class FeatureCache:
    def __init__(self, path: str):
        with open(os.path.join(path, "meta.json")) as f:
            self.meta = json.load(f)
        self.offsets = np.load(os.path.join(path, "offsets.npy"))
        self.layers = {int(l): np.load(os.path.join(path, f"layer_{l}.npy"), mmap_mode="r")
                       for l in self.meta["layers"]}

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


@torch.no_grad()
def build_or_load(staged: StagedTarget, fingerprint: str, examples: list[dict], root: str, dtype: str,
                  log=print, layers: list[int] | None = None) -> FeatureCache:
    """layers: which H^l to store (default: every layer the pipeline's features read, H^L included)."""
    if dtype not in DTYPES:
        raise ValueError(f"teacher cache dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    key = cache_key(fingerprint, staged.bounds, dtype, examples, layers)
    path = os.path.join(root, key)
    if os.path.isfile(os.path.join(path, "meta.json")):
        log(f"teacher-feature cache hit: {path}")
        return FeatureCache(path)
    layers = sorted(layers) if layers is not None else needed_layers(staged.bounds)
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
                   "examples": len(examples), "tokens": int(offsets[-1])}, f)
    os.replace(tmp, path)
    return FeatureCache(path)
