"""Module checkpoints: an HF-style directory (config.json + model.safetensors), written atomically.

config.json carries the target's identity and weight fingerprint, n, the stage boundaries, the feature layers
and the draft vocabulary size (the vocabulary map itself is a tensor in model.safetensors), so a checkpoint
can refuse to run against another target or another n.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from spd.errors import UserError
from spd.models.eagle3 import Eagle3Module
from spd.models.formats.eagle3 import FORMATS, check_head_target, head_config, head_state, layout_of, weights_file
from spd.methods import METHODS, TRAINED_METHODS, module_class
from spd.models.module import SpeculationModule
from spd.models.weights_dir import write_weights_dir
from spd.paths import refuse_authors_head
from spd.targets.loaded import reduced_fingerprints
from spd.targets.loading import LoadedTarget
from spd.targets.stages import StagedTarget

FORMAT = "spd-speculation-module"
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
REQUIRED = ("target", "n", "stage_bounds", "module_layers")


def checkpoint_config(module: SpeculationModule | Eagle3Module, target: LoadedTarget, extra: dict | None = None) -> dict:
    cfg = target.model.config
    head = {
        "format": FORMAT,
        "format_version": 1,
        "target": {"name": target.name, "fingerprint": target.fingerprint,
                   "fingerprints": reduced_fingerprints(target.model), "model_type": cfg.model_type,
                   "num_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size},
    }
    return {**head, **module.checkpoint_fields(cfg.num_hidden_layers), **(extra or {})}


# kept at their own precision when a checkpoint is stored in float16: the draft-vocabulary map (int64) and the
# feature standardisation (float32, a scale that float16 would round)
FLOAT16_KEYS_SKIP = ("draft_to_target", "feature_shift", "feature_scale")


def float16_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's weights in float16 for shipping (load_checkpoint widens them to the run's dtype)."""
    return {k: (v if k in FLOAT16_KEYS_SKIP or not v.is_floating_point() else v.to(torch.float16)).contiguous()
            for k, v in state.items()}


def save_checkpoint(module: SpeculationModule, target: LoadedTarget, path: str, extra: dict | None = None) -> None:
    """Never a half-written checkpoint (spd.models.weights_dir)."""
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    write_weights_dir(path, state, checkpoint_config(module, target, extra), {"format": FORMAT}, WEIGHTS_FILE,
                      CONFIG_FILE)


def read_checkpoint_config(path: str) -> dict:
    """config.json of a module checkpoint, or of an EAGLE-3 head in an engine's layout (spd.models.formats) translated
    into this suite's fields."""
    config_path = os.path.join(path, CONFIG_FILE)
    refuse_authors_head(path)
    if not os.path.isdir(path):
        raise UserError(f"checkpoint directory {path!r} does not exist; pass checkpoint=<dir> of a trained module")
    if not os.path.isfile(config_path):
        raise UserError(f"checkpoint {path!r} has no {CONFIG_FILE}; it is not a module checkpoint")
    try:
        with open(config_path) as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{config_path} is corrupt (not valid JSON); re-save or re-train the checkpoint") from None
    if isinstance(cfg, dict) and cfg.get("format") != FORMAT and layout_of(cfg):
        return head_config(path, cfg)
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        raise UserError(f"{config_path} is neither an SPD module checkpoint (format != {FORMAT!r}) nor an EAGLE-3 "
                        f"head in the {' or '.join(sorted(set(FORMATS.values())))} layout")
    missing = [k for k in REQUIRED if k not in cfg] + \
        [f"target.{k}" for k in ("name", "fingerprint") if not isinstance(cfg.get("target"), dict) or k not in cfg["target"]]
    if missing:
        raise UserError(f"{config_path} lacks {', '.join(missing)}; it is not a complete module checkpoint "
                        "(re-save or re-train it)")
    return cfg


def checkpoint_method(path: str, cfg: dict) -> str:
    """The pipelined drafter a checkpoint was trained as (files written before methods existed are SPD's)."""
    method = cfg.get("method", "spd")
    if method not in TRAINED_METHODS:
        raise UserError(f"{os.path.join(path, CONFIG_FILE)} names method {method!r}, which this version cannot "
                        f"decode ({', '.join(TRAINED_METHODS)}); upgrade spd or re-train the module")
    return method


def check_target(path: str, cfg: dict, target: LoadedTarget) -> None:
    """A checkpoint runs only on the target it was trained for (checked before anything about n or bounds)."""
    if cfg["format"] != FORMAT:
        return check_head_target(path, cfg, target)
    ident = cfg["target"]
    # the same weights in bfloat16 / float16 (a GPU run of a module trained in float32) are the same target
    if target.fingerprint not in (ident["fingerprint"], *(ident.get("fingerprints") or {}).values()):
        raise UserError(f"checkpoint {path!r} was trained for target {ident['name']!r} (fingerprint "
                        f"{ident['fingerprint']}), not {target.name!r} ({target.fingerprint}); use the matching target=")


def load_checkpoint(path: str, staged: StagedTarget, target: LoadedTarget) -> SpeculationModule | Eagle3Module:
    """Build the module the checkpoint describes and load its weights, refusing a foreign target or n."""
    cfg = read_checkpoint_config(path)
    check_target(path, cfg, target)
    if cfg["n"] != staged.n or cfg["stage_bounds"] != staged.bounds:
        raise UserError(f"checkpoint {path!r} is for n={cfg['n']} with stage_bounds={cfg['stage_bounds']}, "
                        f"but this run has n={staged.n}, stage_bounds={staged.bounds}; drop n= or match it")
    if cfg["format"] != FORMAT:
        weights = weights_file(path)
        state = head_state(path, cfg, target.model.get_input_embeddings().weight.detach())
    else:
        weights = os.path.join(path, WEIGHTS_FILE)
        if not os.path.isfile(weights):
            raise UserError(f"checkpoint {path!r} has no {WEIGHTS_FILE}")
        try:
            state = load_file(weights)
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{weights} is corrupt ({str(exc).splitlines()[0]}); re-save or re-train the "
                            "checkpoint") from None
    draft_map = state.get("draft_to_target")
    method = checkpoint_method(path, cfg)
    module = module_class(METHODS[method].module).from_checkpoint_config(staged, method, cfg, draft_map)
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise UserError(f"{weights} does not match its config.json ({str(exc).splitlines()[0]})") from None
    return module.to(device=staged.device, dtype=staged.dtype)
