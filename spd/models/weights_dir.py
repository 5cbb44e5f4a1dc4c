"""A weights directory (model.safetensors + config.json) written whole or not at all: module checkpoints, shipped
modules and exported EAGLE-3 heads all go through here."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file


def write_weights_dir(path: str, state: dict[str, torch.Tensor], config: dict, metadata: dict[str, str],
                      weights: str = "model.safetensors", config_file: str = "config.json") -> None:
    """Write into a temporary sibling directory, then rename it over `path` (the old one kept aside until the new one
    is in place), so a reader never sees half a directory. Readable by every user (mkdtemp's 0700 and the files' 0600
    would hide an installed module or an exported head from an engine's user)."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-weights-", dir=parent)
    try:
        save_file(state, os.path.join(tmp, weights), metadata=metadata)
        with open(os.path.join(tmp, config_file), "w") as f:
            json.dump(config, f, indent=2)
        os.chmod(tmp, 0o755)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        if os.path.isdir(path):
            old = path + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
