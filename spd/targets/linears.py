"""The suite's own products swapped into a target's nn.Linear modules (spd.targets.prepacked, spd.targets.panel), and
the way back to `F.linear` for a while."""

from __future__ import annotations

from contextlib import contextmanager

import torch


class SwappedLinear(torch.nn.Linear):
    """The base of an nn.Linear whose class the suite swapped in place to multiply its own way."""


def swapped_linears(model: torch.nn.Module) -> list[tuple[torch.nn.Module, type]]:
    """Every linear the suite swapped, with its class: what plain_products swaps back (a walk of every module)."""
    return [(m, type(m)) for m in model.modules() if isinstance(m, SwappedLinear)]


@contextmanager
def plain_products(model: torch.nn.Module, swapped: list[tuple[torch.nn.Module, type]] | None = None):
    """`F.linear` inside (transformers' own `generate`, timed as a user has it), each module's own products after.
    swapped: swapped_linears(model), computed once by a caller that enters this every step."""
    swapped = swapped_linears(model) if swapped is None else swapped
    for module, _ in swapped:
        module.__class__ = torch.nn.Linear
    try:
        yield
    finally:
        for module, kind in swapped:
            module.__class__ = kind
