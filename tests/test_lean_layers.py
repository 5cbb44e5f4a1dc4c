"""A Llama layer's forward written out (spd.targets.lean_layers) gives transformers' own layer's bits: prefill rows,
rows after a cache and a draft tree's rows, with the float32 panels (every ISA level), plain F.linear and bfloat16's
row-invariant attention; other families keep their own forward; plain_products swaps it back. (Over a GGUF's blocks
a layer has its own arithmetic: tests/test_own_rows.py.)"""

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from spd.targets import lean_layers, panel
from spd.targets.linears import plain_products
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model

LEVELS = panel.levels() if panel.extension() is not None else ()


def staged_pair(model: torch.nn.Module) -> tuple[StagedTarget, StagedTarget]:
    """`model` staged (its layers written out) and a staged copy with transformers' own layer forward."""
    twin = copy.deepcopy(model)
    staged, own = StagedTarget(model, 1), StagedTarget(twin, 1)
    for layer in twin.model.layers:
        layer.__class__ = LlamaDecoderLayer
    return staged, own


def rows_logits(staged: StagedTarget, ids: torch.Tensor) -> list[torch.Tensor]:
    """Logits of: the whole prompt in one forward; 1, 3 and 6 rows after 20 cached positions; a 5-node tree (two
    branches) after those 20."""
    out = [staged.logits(staged.forward_all(ids, None)[0])]
    for rows in (1, 3, 6):
        cache = staged.new_cache()
        staged.forward_all(ids[:, :20], cache)
        out.append(staged.logits(staged.forward_all(ids[:, 20:20 + rows], cache, start_pos=20)[0]))
    visible = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 0, 0, 1]],
                           dtype=torch.bool)
    cache = staged.new_cache()
    staged.forward_all(ids[:, :20], cache)
    out.append(staged.logits(staged.forward_all(ids[:, 20:25], cache, 20, visible=visible,
                                                offsets=torch.tensor([0, 1, 1, 2, 2]))[0]))
    return out


PRODUCTS = [f"panels-{level}" for level in LEVELS] + ["F.linear", "bfloat16"]


@pytest.mark.parametrize("products", PRODUCTS)
def test_a_written_out_llama_layer_has_transformers_bits(products, monkeypatch):
    kind, _, level = products.partition("-")
    if level:
        monkeypatch.setenv(panel.LEVEL_ENV, level)
    if kind == "F.linear":
        monkeypatch.setenv(panel.PLAIN_ENV, "1")
    # bfloat16 256 wide (heads of 64): its products pass the row check there, so its row-invariant attention runs
    wide = dict(hidden_size=256, head_dim=64, num_layers=4) if kind == "bfloat16" else {}
    model = tiny_model("llama", seed=5, tied=False, **wide)
    if kind == "bfloat16":
        model = model.to(torch.bfloat16)
    staged, own = staged_pair(model)
    assert kind != "bfloat16" or staged.row_invariant
    assert all(type(layer) is lean_layers.LeanLlamaLayer for layer in model.model.layers)
    # from panels, the work around the attention is the C++ glue's; otherwise the Python forward
    assert all((lean_layers._packs(layer) is not None) == (kind == "panels") for layer in model.model.layers)
    assert staged.weights == "float32" and staged.panels == (kind == "panels")
    ids = torch.randint(0, model.config.vocab_size, (1, 28), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        for got, want in zip(rows_logits(staged, ids), rows_logits(own, ids)):
            assert torch.equal(got, want)


def test_other_families_keep_their_forward_and_plain_products_swaps_it_back():
    qwen = tiny_model("qwen3", seed=1)
    StagedTarget(qwen, 1)
    assert lean_layers.lean(qwen) == 0 and not any(isinstance(m, lean_layers.LeanLlamaLayer) for m in qwen.modules())
    llama = tiny_model("llama", seed=1)
    StagedTarget(llama, 1)
    assert type(llama.model.layers[0]) is lean_layers.LeanLlamaLayer
    with plain_products(llama):
        assert all(type(layer) is LlamaDecoderLayer for layer in llama.model.layers)
    assert all(type(layer) is lean_layers.LeanLlamaLayer for layer in llama.model.layers)
    trained = tiny_model("llama", seed=1).train()
    assert lean_layers.lean(trained) == 0        # training keeps transformers' forward
