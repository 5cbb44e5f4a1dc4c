"""What one verification forward of r rows costs on this machine (spd.pricing.RowCosts): the target over r new
rows after `context` cached tokens, and its head over all r, the shapes taking turns so that a slow moment of the
machine is shared by all of them. Measured once per machine, target, dtype and thread count and kept under the
suite's cache directory (like the stage-balance profile), since the curve is the machine's, not the run's.

Each row count is timed every way a product of few rows can be multiplied (`F.linear`; the weight as left operand
for spd.targets.ragged.CANDIDATES; oneDNN's prepacked weights for 2 rows or more: spd.targets.ragged.few_rows_linear);
which is fastest depends on the CPU and its BLAS, so the profile keeps the fastest one's cost and the row counts where
each other product won, and every multi-row decoder installs that choice (`use_machine_products`)."""

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
from spd.targets import ragged
from spd.targets.stages import StagedTarget
from spd.timing import sync
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
    and the target's shape and dtype."""
    config = staged.config
    device = staged.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    payload = [name, os.cpu_count(), str(device), torch.get_num_threads(), str(staged.dtype),
               config.model_type, config.hidden_size, config.num_hidden_layers, config.vocab_size]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


@torch.no_grad()
def measure_row_costs(staged: StagedTarget, max_rows: int, context: int = 256,
                      rounds: int = 9) -> tuple[RowCosts, frozenset[int], frozenset[int]]:
    """Median seconds of a forward of 1..max_rows rows (embedding, every layer, the head over every row) after
    `context` cached tokens, each timed right after a one-row forward (as in a decode loop), each row count with
    `F.linear`, those of ragged.CANDIDATES also weight-first and
    every count of 2 or more with oneDNN's prepacked weights; each round times every shape once, in turn. Returns
    the costs (the fastest product's) and the row counts where weight-first and where the prepacked product won."""
    device = staged.device
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(staged.config.vocab_size, (1, context + max_rows), generator=generator).to(device)
    cache = staged.new_cache(context + max_rows)
    staged.forward_all(ids[:, :context], cache, 0)

    def forward(rows: int, product: str) -> None:
        ragged.FEW_ROWS = frozenset([rows]) if product == "weight_first" else frozenset()
        ragged.PACKED_ROWS = frozenset([rows]) if product == "packed" else frozenset()
        with ragged.few_rows_products():
            out, _ = staged.forward_all(ids[:, context: context + rows], cache, context)
            staged.logits(out[0])
        cache.crop(context)

    def plain_step() -> None:
        # what precedes a verification in a decode loop: a one-row forward (an AR step, a priced-out cycle) reads
        # the plain weights. Timed alone, a product would find its own weights in the cache from the shape before;
        # after a plain step a prepacked copy does not (the Intel Xeon with AMX: 16 rows 60.7 ms alone, 65.5 after
        # a 3-row plain forward, against F.linear's 64.8 and 67.6; "Tenth look")
        out, _ = staged.forward_all(ids[:, context: context + 1], cache, context)
        staged.logits(out[0])
        cache.crop(context)

    cpu = device.type == "cpu"          # few_rows_linear multiplies CPU tensors only
    shapes = [(rows, "linear") for rows in range(1, max_rows + 1)]
    shapes += [(rows, "weight_first") for rows in ragged.CANDIDATES if cpu and rows <= max_rows]
    if cpu and ragged.PACKING and staged.dtype == torch.float32:
        shapes += [(rows, "packed") for rows in range(2, max_rows + 1)]
    times: dict[tuple[int, str], list[float]] = {shape: [] for shape in shapes}
    installed = ragged.FEW_ROWS, ragged.PACKED_ROWS
    try:
        for round_ in range(rounds + 1):
            for shape in shapes:
                plain_step()
                sync(device)
                start = time.perf_counter()
                forward(*shape)
                sync(device)
                if round_:              # the first round warms every shape up (and packs the weights)
                    times[shape].append(time.perf_counter() - start)
    finally:
        ragged.FEW_ROWS, ragged.PACKED_ROWS = installed
    median = {shape: statistics.median(t) for shape, t in times.items()}
    best = {rows: min((m, product) for (r, product), m in median.items() if r == rows)
            for rows in range(1, max_rows + 1)}
    seconds = tuple(best[rows][0] for rows in range(1, max_rows + 1))
    won = {product: frozenset(rows for rows, (_, p) in best.items() if p == product)
           for product in ("weight_first", "packed")}
    return RowCosts(seconds), won["weight_first"], won["packed"]


def _profile(staged: StagedTarget, max_rows: int) -> tuple[RowCosts, frozenset[int], frozenset[int]]:
    """This machine's profile of at least max_rows rows from the cache, measured (seconds) and kept the first time.
    A profile measured another way (an older PROFILE_VERSION, or none) is measured again."""
    path = os.path.join(cache_root(), "row_costs", f"{machine_key(staged)}.json")
    if os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
        if len(saved["seconds"]) >= max_rows and saved.get("version") == PROFILE_VERSION:
            return RowCosts(tuple(saved["seconds"])), frozenset(saved["weight_first"]), frozenset(saved["packed"])
    costs, weight_first, packed = measure_row_costs(staged, max_rows)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path, {"version": PROFILE_VERSION, "seconds": list(costs.seconds),
                             "weight_first": sorted(weight_first),
                             "packed": sorted(packed), "cpu": _cpu_name(), "threads": torch.get_num_threads()})
    return costs, weight_first, packed


def cached_row_costs(staged: StagedTarget, max_rows: int) -> RowCosts:
    """This machine's costs of 1..max_rows rows (the cached profile), with its products installed: the costs hold
    only when the rows are multiplied the way they were timed."""
    costs, ragged.FEW_ROWS, ragged.PACKED_ROWS = _profile(staged, max(max_rows, PROFILED_ROWS))
    return RowCosts(costs.seconds[:max_rows])


def use_machine_products(staged: StagedTarget) -> tuple[frozenset[int], frozenset[int]]:
    """Install this machine's choice of product for few rows (spd.targets.ragged.FEW_ROWS and PACKED_ROWS), measured
    once and cached with the row costs; a GPU target multiplies with `F.linear` (nothing to install)."""
    if staged.device.type != "cpu":
        return frozenset(), frozenset()
    if staged not in _INSTALLED:    # a decoder is built per request in places: read the profile once per target
        cached_row_costs(staged, PROFILED_ROWS)
        _INSTALLED[staged] = ragged.FEW_ROWS, ragged.PACKED_ROWS
        if ragged.PACKED_ROWS:
            with torch.no_grad():
                ragged.pack_linears(staged.model)
    ragged.FEW_ROWS, ragged.PACKED_ROWS = _INSTALLED[staged]
    return _INSTALLED[staged]


# 2: every product timed right after a plain one-row forward, prepacked weights among the products (1: weight-first
# and F.linear, each shape timed after the previous shape)
PROFILE_VERSION = 2
# every profile covers the rows of a default tree's forward (16 nodes and its root), so the products of any
# verification up to that size are chosen by measurement
PROFILED_ROWS = 17
_INSTALLED: "weakref.WeakKeyDictionary[StagedTarget, tuple[frozenset[int], frozenset[int]]]" = \
    weakref.WeakKeyDictionary()
