"""What the controller and the stage processes say to each other, and who holds what.

Ranks: 0 is the controller (embedding, speculation module, verification); rank s + 1 runs stage s (0-indexed)
and only that stage's layers; the last stage also holds the final norm and the LM head. When the controller
*hosts* stage 0 (`controller=first_stage`: n processes for n stages, so that n stages fit n cores), rank 0 runs
stage 0 itself and rank s runs stage s.

Per step the controller sends every stage process one control tensor (int64 [6 + n + 4nW]: command, crop length,
prompt length, capture flag, context length (PREFILL: the positions of the static caches the stages allocate),
argmax flag (greedy: the last stage sends the exiting token's argmax instead of its logits row), the schedule's
work row: the position (FlowSpec: the segment) each stage advances, IDLE if none; then the flight: id, position,
parent and level (or segment) of every node in flight, from which each stage masks its level's rows and drops what a verified child pruned, as
`runtime=local` does) and stage 0 the H^0 of the entering level's nodes (a hosted stage 0 runs in the controller
instead). Stage s sends its output state to stage s + 1 (used next step,
or dropped when the next control crops past it) and the controller its payload: the captured feature rows the
drafter reads, and for the last stage the logits (or the argmax) of each exiting token. Tags keep the kinds of
message apart.

Several sequences (`Setup.slots` > 1, SEED's schedule, spd.runtime.seed): the control message is one such row per
slot — a sequence's index in every stage process, which keeps a cache and rows per slot — each with its own command
(NONE: the slot has nothing this message). A step's rows of every slot that runs a stage travel as one message, in
slot order: the H^0 rows to stage 0, the output rows to the next stage, the payloads (each slot's captured rows,
then its exit) to the controller; a stage runs them in one forward (spd.targets.ragged). PREFILL and END are per slot,
STOP and ABORT for all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spd.runtime.flight import Flight, SegmentFlight

NONE, PREFILL, STEP, END, STOP, ABORT, PROBE = 0, 1, 2, 3, 4, 5, 6  # PROBE: a STEP's messages, no compute
TAG_CONTROL, TAG_HIDDEN, TAG_PREFILL, TAG_PAYLOAD, TAG_READY = 1, 2, 3, 4, 5
HEADER = 6


@dataclass
class Setup:
    """Broadcast once from the controller: everything a stage process needs to load and run its stage."""

    cache_dir: str                  # spd.targets.weight_cache cache of the target
    n: int
    bounds: list[int]
    capture: list[int]              # layers whose H^l the drafter reads (0 excluded: the controller embeds)
    dtype: str = "float32"
    weights: str = "float32"        # q4: the stage multiplies the GGUF's own blocks (spd.targets.blocks)
    device: str = "cpu"
    threads: int = 1
    step_timeout_s: float = 20.0
    idle_timeout_s: float = 86400.0
    abort: str | None = None        # the controller refused the run: stages exit quietly
    hosted: bool = False            # the controller runs stage 0 itself (n processes, not n + 1)
    width: int = 1                  # W: tree levels of up to W nodes (the control rows are sized for it)
    slots: int = 1                  # sequences the stages hold at once (one control row each)
    nccl: bool = False              # hand-offs go GPU to GPU in the target's dtype (placement.gpus_apart)
    extra: dict = field(default_factory=dict)


def first_remote(hosted: bool) -> int:
    """The first stage that runs in a stage process."""
    return 1 if hosted else 0


def rank_of(stage: int, hosted: bool) -> int:
    return stage if hosted else stage + 1


def world_size(n: int, hosted: bool) -> int:
    return n if hosted else n + 1


def stage_layers(bounds: list[int], stage: int) -> range:
    return range(bounds[stage], bounds[stage + 1])


def stage_capture(capture: list[int], bounds: list[int], stage: int) -> list[int]:
    """Captured layers whose H^l is produced by `stage` (the outputs of its layers), ascending."""
    return [layer for layer in sorted(capture) if bounds[stage] < layer <= bounds[stage + 1]]


def control_size(n: int, width: int) -> int:
    """Ints in a control row: the header, the work row, then the flight (up to n levels or segments of W nodes, 4
    ints each)."""
    return HEADER + n + 4 * n * width


def message(rows: dict[int, torch.Tensor], n: int, width: int, slots: int) -> torch.Tensor:
    """One control message: each slot's row (NONE where `rows` has none), in slot order."""
    idle = control(NONE, n, width)
    return torch.cat([rows.get(slot, idle) for slot in range(slots)])


def parse_message(values: torch.Tensor, n: int, width: int, slots: int) -> list["Control"]:
    size = control_size(n, width)
    return [parse(values[slot * size: (slot + 1) * size], n, width) for slot in range(slots)]


def control(cmd: int, n: int, width: int = 1, crop: int = -1, length: int = 0, capture: bool = True,
            work: tuple[int, ...] | None = None, context: int = 0, argmax: bool = False,
            flight: Flight | SegmentFlight | None = None) -> torch.Tensor:
    row = [cmd, crop, length, int(capture), context, int(argmax)] + list(work if work is not None else (-1,) * n)
    nodes = [] if flight is None else [(node, pos, -1 if parent is None else parent, group)
                                       for node, pos, parent, group in flight.structure()]
    if len(nodes) > n * width:
        raise ValueError(f"{len(nodes)} nodes in flight exceed n * W = {n * width} (the pipeline was set up for "
                         f"W={width})")
    row += [v for node in nodes for v in node] + [-1] * (4 * (n * width - len(nodes)))
    return torch.tensor(row, dtype=torch.long)


@dataclass(frozen=True)
class Control:
    cmd: int
    crop: int                   # -1: nothing to forget
    length: int                 # PREFILL: prompt length
    capture: bool
    context: int                # PREFILL: positions of the static caches (0: a growing cache)
    argmax: bool                # the last stage sends the exiting token's argmax only
    work: tuple[int, ...]
    flight: SegmentFlight       # STEP: the tree nodes in flight (ids, positions, parents, levels or segments; no
                                # tokens)


def parse(row: torch.Tensor, n: int, width: int = 1) -> Control:
    values = row.tolist()
    cells = values[HEADER + n:]
    nodes = [tuple(cells[i: i + 4]) for i in range(0, len(cells), 4) if cells[i] >= 0]
    flight = SegmentFlight.restore([(node, pos, None if parent < 0 else parent, group)
                                    for node, pos, parent, group in nodes])
    return Control(values[0], values[1], values[2], bool(values[3]), values[4], bool(values[5]),
                   tuple(values[HEADER: HEADER + n]), flight)


# The argmax travels in the float32 payload: exact for token ids below 2**24.
MAX_ARGMAX_VOCAB = 2 ** 24
