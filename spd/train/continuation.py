"""`init_from=`: a run that continues a trained module's distillation instead of starting from random weights.

The module's weights, draft vocabulary and feature standardisation start the run (they are what the module learnt;
a new draft vocabulary or new statistics would make its head and FCs mean something else); its steps and training
tokens count on, and the data order picks up at the step it stopped at, so a continued run does not see the first
batches again. The optimizer's moments are not in a module checkpoint (only a run's ds_state/ has them): a continued
run builds them afresh under its own warm-up, which is why its lr schedule is a new cycle.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from spd.models.checkpoint import load_checkpoint, read_checkpoint_config
from spd.errors import UserError
from spd.methods import METHODS, module_class
from spd.models.shipped import SHIPPED_DIR


@dataclass(frozen=True)
class Continued:
    """Where a continued run starts: the module's path, its steps and tokens so far, and its training data's hash."""
    path: str
    step: int
    tokens: int
    data_sha256: str | None

    def record(self) -> dict:
        return {"path": self.path, "step": self.step, "train_tokens": self.tokens, "data_sha256": self.data_sha256}


def resolve(init_from: str) -> str:
    """A checkpoint directory, or a shipped module's name (e.g. smollm2-n5)."""
    if os.path.isdir(init_from):
        return init_from
    shipped = os.path.join(SHIPPED_DIR, init_from)
    if os.path.isfile(os.path.join(shipped, "config.json")):
        return shipped
    names = sorted(os.listdir(SHIPPED_DIR)) if os.path.isdir(SHIPPED_DIR) else []
    raise UserError(f"init_from={init_from!r} is neither a checkpoint directory nor a shipped module "
                    f"({', '.join(names) or 'none shipped'}); pass one of them")


def load_continued(cfg, staged, loaded):
    """(module, Continued) for cfg.init_from, refusing a module whose shape is not what the config asks for."""
    path = resolve(cfg.init_from)
    saved = read_checkpoint_config(path)
    m = cfg.model
    method = saved.get("method", "spd")
    want = {"method": (method, cfg.method), "model.module_layers": (saved.get("module_layers"), m.module_layers),
            "model.draft_vocab": (saved.get("draft_vocab_size") or 0, m.draft_vocab),
            "model.feature_norm": (saved.get("feature_norm", "none"), m.feature_norm),
            "model.fc_bias": (saved.get("fc_bias", False), m.fc_bias)}
    # only the keys the method's module class has (EAGLE-3's: its draft vocabulary)
    fixed = module_class(METHODS[method].module).shape_keys if method in METHODS and METHODS[method].trained else ()
    want = {key: value for key, value in want.items() if key == "method" or key.split(".", 1)[1] in fixed}
    differ = [f"{key}={json.dumps(ours)} (the module has {json.dumps(theirs)})" for key, (theirs, ours) in want.items() if theirs != ours]
    if differ:
        raise UserError(f"init_from={cfg.init_from!r} cannot continue as this config asks: {'; '.join(differ)}; "
                        "set the keys to the module's values")
    module = load_checkpoint(path, staged, loaded)      # refuses a foreign target, n or stage bounds
    training = saved.get("training") or saved.get("provenance") or {}
    return module, Continued(path=os.path.abspath(path), step=int(saved.get("step") or 0),
                             tokens=int(saved.get("train_tokens") or 0), data_sha256=training.get("data_sha256"))
