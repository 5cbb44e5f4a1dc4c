"""What one verification forward of r rows costs on this machine (spd.pricing.RowCosts): the target over r new
rows after `context` cached tokens, and its head over all r, the shapes taking turns so that a slow moment of the
machine is shared by all of them. Measured once per machine, target, dtype and thread count and kept under the
suite's cache directory (like the stage-balance profile), since the curve is the machine's, not the run's.

Each row count of spd.targets.ragged.CANDIDATES is timed both ways a product of few rows can be multiplied
(`F.linear`, and the weight as left operand: spd.targets.ragged.few_rows_linear); which is faster depends on the
CPU and its BLAS, so the profile keeps the faster one's cost and the row counts where the weight-first product won,
and every multi-row decoder installs that choice (`use_machine_products`)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
import weakref

import torch

from spd.pricing import RowCosts
from spd.targets import invariant_attention, panel, ragged
from spd.targets.stages import StagedTarget
from spd.targets.timing import sync
from spd.targets.weight_cache import cache_root, write_json_atomic


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(staged: StagedTarget) -> str:
    """The cache key of a row-cost profile: this machine's processor and core count, the device, the thread count,
    and the target's shape, dtype and products (plain, prepacked or panels)."""
    config = staged.config
    device = staged.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    payload = [name, os.cpu_count(), str(device), torch.get_num_threads(), str(staged.dtype),
               config.model_type, config.hidden_size, config.num_hidden_layers, config.vocab_size]
    if getattr(staged, "prepacked", False):     # another curve (spd.targets.prepacked); float32 keys stay as they were
        payload.append("prepacked")
    if getattr(staged, "panels", False):        # another curve (spd.targets.panel), each version of the kernel its own
        payload.append(f"panels {panel.source_key()} {staged.panel_level}")   # each ISA level its own curve
    if getattr(staged, "weights", "float32") != "float32":   # another curve: a GGUF's blocks (spd.targets.blocks)
        payload.append(f"weights {staged.weights}")
    if getattr(staged, "packed_gqa", False):    # another curve (spd.targets.gqa_attention): no K/V copies past 1 row
        payload.append("packed gqa")
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


@torch.no_grad()
def measure_row_costs(staged: StagedTarget, max_rows: int, context: int = 256,
                      rounds: int = 9) -> tuple[RowCosts, frozenset[int]]:
    """Median seconds of a forward of 1..max_rows rows (embedding, every layer, the head over every row) after
    `context` cached tokens, each row count of ragged.CANDIDATES both with `F.linear` and weight-first; each round
    times every shape once, in turn. Returns the costs (the faster product's) and the row counts weight-first won."""
    device = staged.device
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(staged.config.vocab_size, (1, context + max_rows), generator=generator).to(device)
    cache = staged.new_cache(context + max_rows, rollback=max_rows)
    staged.forward_all(ids[:, :context], cache, 0)

    def forward(rows: int, weight_first: bool) -> None:
        ragged.FEW_ROWS = frozenset([rows]) if weight_first else frozenset()
        with ragged.few_rows_products():
            out, _ = staged.forward_all(ids[:, context: context + rows], cache, context)
            staged.logits(out[0])
        cache.crop(context)

    # few_rows_linear multiplies CPU tensors only, and not a row-invariant target's (spd.targets.invariant_attention)
    # nor one whose Linears multiply from panels (spd.targets.panel: F.linear is not called)
    both = device.type == "cpu" and not invariant_attention.wanted(device, staged.dtype) and \
        not getattr(staged, "panels", False)
    shapes = [(rows, False) for rows in range(1, max_rows + 1)]
    shapes += [(rows, True) for rows in ragged.CANDIDATES if both and rows <= max_rows]
    times: dict[tuple[int, bool], list[float]] = {shape: [] for shape in shapes}
    installed = ragged.FEW_ROWS
    try:
        for round_ in range(rounds + 1):
            for shape in shapes:
                sync(device)
                start = time.perf_counter()
                forward(*shape)
                sync(device)
                if round_:              # the first round warms every shape up
                    times[shape].append(time.perf_counter() - start)
    finally:
        ragged.FEW_ROWS = installed
    median = {shape: statistics.median(t) for shape, t in times.items()}
    weight_first = frozenset(rows for rows, first in median if first and median[rows, True] < median[rows, False])
    seconds = tuple(median[rows, rows in weight_first] for rows in range(1, max_rows + 1))
    return RowCosts(seconds), weight_first


def _profile(staged: StagedTarget, max_rows: int) -> tuple[RowCosts, frozenset[int]]:
    """This machine's profile of at least max_rows rows from the cache, measured (seconds) and kept the first time.
    A profile from before the products were compared (no "weight_first" entry) is measured again."""
    path = os.path.join(cache_root(), "row_costs", f"{machine_key(staged)}.json")
    if os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
        if len(saved["seconds"]) >= max_rows and "weight_first" in saved:
            return RowCosts(tuple(saved["seconds"])), frozenset(saved["weight_first"])
    costs, weight_first = measure_row_costs(staged, max_rows)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path, {"seconds": list(costs.seconds), "weight_first": sorted(weight_first),
                             "cpu": _cpu_name(), "threads": torch.get_num_threads()})
    return costs, weight_first


def cached_row_costs(staged: StagedTarget, max_rows: int) -> RowCosts:
    """This machine's costs of 1..max_rows rows (the cached profile), with its products installed: the costs hold
    only when the rows are multiplied the way they were timed."""
    costs, weight_first = _profile(staged, max(max_rows, max(ragged.CANDIDATES)))
    ragged.FEW_ROWS = weight_first
    return RowCosts(costs.seconds[:max_rows])


def use_machine_products(staged: StagedTarget) -> frozenset[int]:
    """Install this machine's choice of product for few rows (spd.targets.ragged.FEW_ROWS), measured once and
    cached with the row costs; a GPU target multiplies with `F.linear` (nothing to install)."""
    if staged.device.type != "cpu":
        return frozenset()
    if staged not in _INSTALLED:    # a decoder is built per request in places: read the profile once per target
        cached_row_costs(staged, max(ragged.CANDIDATES))
        _INSTALLED[staged] = ragged.FEW_ROWS
    ragged.FEW_ROWS = _INSTALLED[staged]
    return ragged.FEW_ROWS


_INSTALLED: "weakref.WeakKeyDictionary[StagedTarget, frozenset[int]]" = weakref.WeakKeyDictionary()
