"""Run inside the `speculators` venv (bench/speculators_check.py builds it): load an exported head with speculators'
own Eagle3DraftModel and write the draft logits its forward computes for the given inputs.

    <venv>/bin/python bench/speculators_side.py <head dir> <inputs.safetensors> <out.safetensors> <ttt steps>

Imports nothing of this suite (its pins differ). The logits are read with a hook on the model's lm_head, so they are
exactly what its forward computes; its forward's own argmax drafts are written beside them.
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file


def main(head: str, inputs: str, out: str, steps: int) -> None:
    from importlib.metadata import version
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(head)
    config.transformer_layer_config._attn_implementation = "eager"   # flex attention wants a GPU compile
    model = Eagle3DraftModel.from_pretrained(head, config=config).float().eval()
    written = set(load_file(f"{head}/model.safetensors"))
    wanted = {k for k in model.state_dict() if not k.startswith("verifier_")}   # the target's, never saved
    data = load_file(inputs)
    logits = []
    model.lm_head.register_forward_hook(lambda module, args, output: logits.append(output.detach().clone()))
    with torch.no_grad():
        drafts = model(hidden_states=data["aux"], input_ids=data["input_ids"],
                       document_ids=torch.zeros_like(data["input_ids"]), ttt_steps=steps)
    result = {f"logits_{j}": t for j, t in enumerate(logits)}
    result.update({f"drafts_{j}": d for j, d in enumerate(drafts)})
    save_file({k: v.contiguous() for k, v in result.items()}, out)
    print(json.dumps({"speculators": version("speculators"), "class": type(model).__name__,
                      "missing_keys": sorted(wanted - written), "unexpected_keys": sorted(written - wanted),
                      "aux_layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids),
                      "norm_before_residual": bool(model.config.norm_before_residual),
                      "torch": torch.__version__, "transformers": __import__("transformers").__version__}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
