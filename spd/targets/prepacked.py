"""bfloat16 products on a CPU with each weight prepacked once for oneDNN.

`F.linear` in bfloat16 on a CPU hands oneDNN a plain [out, in] weight, which it reorders into its own blocked layout
on every call; over SmolLM2's 211 weights that reorder is most of a forward of a few rows (experiments/product_shapes.py
--layouts: 8 rows 72 ms plain against 55 prepacked, 16 rows 67 against 62). Prepacked
(`torch.ops.mkldnn._reorder_linear_weight`, the op `torch.compile` uses for a frozen CPU Linear), the same product
runs from the packed copy. It is used only where it keeps a row's bits independent of the rows beside it — the
premise of spd.targets.invariant_attention, checked for this target's shapes when it loads — so AR and every drafted
decoder still compute each row alike. float32 keeps `F.linear`: there a packed copy beside the plain weights read by
the one-row step moved more bytes through a cache both do not fit (docs/speed-cpu.md, "What was tried and did not pay").

The packed copies live beside the model (a Linear keeps its weight, which the state dict, an embedding tied to the
head and the weight cache read), are made when the target is staged and again after an in-place change of a weight;
a Linear whose weight is not on the CPU in bfloat16, or that autograd must differentiate, multiplies with `F.linear`.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

from spd.targets.linears import SwappedLinear


def available() -> bool:
    """oneDNN with bfloat16 kernels for this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU has none)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") and \
        torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., d_in] times the packed weight [d_out, d_in]^T (+ bias) -> [..., d_out]."""
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


_PACKED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, torch.Tensor]]" = weakref.WeakKeyDictionary()


def _usable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and not weight.requires_grad


def _key(weight: torch.Tensor) -> tuple:
    return weight.data_ptr(), weight._version, tuple(weight.shape)


def packed_weight(module: torch.nn.Linear) -> torch.Tensor | None:
    """The module's packed weight, packed again if the weight changed since; None where it cannot be used."""
    weight = module.weight
    if not _usable(weight):
        return None
    key = _key(weight)
    held = _PACKED.get(module)
    if held is None or held[0] != key:
        held = key, _pack(weight)
        _PACKED[module] = held
    return held[1]


class PrepackedLinear(SwappedLinear):
    """An nn.Linear (its class swapped in place) that multiplies with its weight's packed copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = packed_weight(self)
        if packed is None or x.dtype != torch.bfloat16 or (torch.is_grad_enabled() and x.requires_grad):
            return F.linear(x, self.weight, self.bias)
        return packed_product(x, packed, self.bias)


def prepack(model: torch.nn.Module) -> None:
    """Every Linear of `model` multiplies from a packed copy of its weight (packed now where the weight is held here:
    a pipeline stage's process holds only its own layers)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.__class__ = PrepackedLinear
            packed_weight(module)


@functools.lru_cache(maxsize=None)
def packed_invariant(shapes: tuple[tuple[int, int], ...], rows: int = 17) -> bool:
    """Whether the packed product gives a row the same bits in a call of 1 row as of 2..`rows`, for these (in, out)
    shapes (inputs that make a sum's order visible, as spd.targets.invariant_attention.products_invariant)."""
    from spd.targets.invariant_attention import same_bits_at_every_row_count

    def product(d_in: int, d_out: int):
        packed = _pack(torch.ones(d_out, d_in, dtype=torch.bfloat16))
        return lambda x, w: packed_product(x, packed, None)

    return available() and all(same_bits_at_every_row_count(i, o, product(i, o), rows) for i, o in shapes)
