"""The read-only step views the pipeline hands its drafter (`spd.drafters.base.StepView`), built from the runtime's
schedule and flight: drafters see plain tokens, positions, depths and states, never the runtime's own objects."""

from __future__ import annotations

from types import MappingProxyType

import torch

from spd.drafters.base import InFlight, StepView
from spd.runtime.flight import Flight
from spd.runtime.schedule import Step


def branch_view(step: Step, flight: Flight, tip: int, features: dict[int, dict[int, torch.Tensor]],
                after: bool = False) -> StepView:
    """The step as the branch ending at `tip` (a node of the newest level) sees it: the tip's ancestors in flight
    and the tip, at their depths. features: {node: {layer: H^l [1, 1, d]}}. For a chain, the whole step."""
    items = tuple(InFlight(flight.token(node), flight.nodes[node].pos,
                           min(step.n, step.t - flight.nodes[node].pos + after), MappingProxyType(features[node]),
                           node)
                  for node in flight.branch(tip))
    assert len(items) == step.occupancy, "every level in flight holds one ancestor of each tip"
    return StepView(step.t, step.occupancy, step.n, items)


def step_view(step: Step, tokens: list[int], features: dict[int, dict[int, torch.Tensor]],
              after: bool = False) -> StepView:
    """A chain's step from its tokens by position. features: {pos: {layer: H^l [1, 1, d]}} of the step's positions
    t-occupancy+1..t."""
    items = tuple(InFlight(tokens[pos], pos, min(step.n, k + after), MappingProxyType(features[pos]))
                  for pos, k in step.in_flight())
    return StepView(step.t, step.occupancy, step.n, items)
