"""The suite's own products swapped into a target's nn.Linear modules (spd.targets.prepacked, spd.targets.panel), and
the way back to `F.linear` for a while."""

from __future__ import annotations

from contextlib import contextmanager

import torch


class SwappedLinear(torch.nn.Linear):
    """The base of an nn.Linear whose class the suite swapped in place to multiply its own way."""


@contextmanager
def plain_products(model: torch.nn.Module):
    """`F.linear` inside (transformers' own `generate`, timed as a user has it), each module's own products after."""
    swapped = [(m, type(m)) for m in model.modules() if isinstance(m, SwappedLinear)]
    for module, _ in swapped:
        module.__class__ = torch.nn.Linear
    try:
        yield
    finally:
        for module, kind in swapped:
            module.__class__ = kind
