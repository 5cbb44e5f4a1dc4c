"""What one verification forward of r rows costs on this machine (spd.pricing.RowCosts): the target over r new
rows after `context` cached tokens, and its head over all r, the shapes taking turns so that a slow moment of the
machine is shared by all of them. Measured once per machine, target, dtype and thread count and kept under the
suite's cache directory (like the stage-balance profile), since the curve is the machine's, not the run's."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time

import torch

from spd.pricing import RowCosts
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
def measure_row_costs(staged: StagedTarget, max_rows: int, context: int = 256, rounds: int = 9) -> RowCosts:
    """Median seconds of a forward of 1..max_rows rows (embedding, every layer, the head over every row) after
    `context` cached tokens; each round times every row count once, in turn."""
    device = staged.device
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(staged.config.vocab_size, (1, context + max_rows), generator=generator).to(device)
    cache = staged.new_cache(context + max_rows)
    staged.forward_all(ids[:, :context], cache, 0)

    def forward(rows: int) -> None:
        out, _ = staged.forward_all(ids[:, context: context + rows], cache, context)
        staged.logits(out[0])
        cache.crop(context)

    times: dict[int, list[float]] = {rows: [] for rows in range(1, max_rows + 1)}
    for round_ in range(rounds + 1):
        for rows in times:
            sync(device)
            start = time.perf_counter()
            forward(rows)
            sync(device)
            if round_:              # the first round warms every shape up
                times[rows].append(time.perf_counter() - start)
    return RowCosts(tuple(statistics.median(times[rows]) for rows in sorted(times)))


def cached_row_costs(staged: StagedTarget, max_rows: int) -> RowCosts:
    """This machine's profile from the cache, measured (a few seconds) and kept the first time."""
    path = os.path.join(cache_root(), "row_costs", f"{machine_key(staged)}.json")
    if os.path.isfile(path):
        with open(path) as f:
            seconds = json.load(f)["seconds"]
        if len(seconds) >= max_rows:
            return RowCosts(tuple(seconds[:max_rows]))
    costs = measure_row_costs(staged, max_rows)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path, {"seconds": list(costs.seconds), "cpu": _cpu_name(), "threads": torch.get_num_threads()})
    return costs
