"""The suite's own products swapped into a target's nn.Linear modules (spd.targets.prepacked, spd.targets.panel), and
the way back to `F.linear` for a while."""

from __future__ import annotations

from contextlib import contextmanager

import torch


class SwappedLinear(torch.nn.Linear):
    """The base of an nn.Linear whose class the suite swapped in place to multiply its own way."""

    suite_plain = torch.nn.Linear       # the class plain_products swaps back to


def swapped_linears(model: torch.nn.Module) -> list[tuple[torch.nn.Module, type]]:
    """Every module the suite swapped (its linears, and layers whose forward it wrote out: spd.targets.lean_layers),
    with its class: what plain_products swaps back (a walk of every module)."""
    return [(m, type(m)) for m in model.modules() if getattr(type(m), "suite_plain", None) is not None]


@contextmanager
def plain_products(model: torch.nn.Module, swapped: list[tuple[torch.nn.Module, type]] | None = None):
    """`F.linear` and transformers' own layer forwards inside (its `generate`, timed as a user has it), each module's
    own after. swapped: swapped_linears(model), computed once by a caller that enters this every step."""
    swapped = swapped_linears(model) if swapped is None else swapped
    for module, kind in swapped:
        module.__class__ = kind.suite_plain
    try:
        yield
    finally:
        for module, kind in swapped:
            module.__class__ = kind
