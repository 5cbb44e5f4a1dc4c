"""Timing a piece of work on a device: the median of repeated runs, the device synchronised around each one.
Below everything that measures (the stage-balance profile, the eval's cost calibration, benchmarks), so none of them
reaches into another for it."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], repeats: int, device: torch.device,
                   reset: Callable[[], None] = lambda: None, warmup: int = 3) -> float:
    """Median wall time of fn(); `reset` runs after every call, outside the timer (e.g. a cache crop)."""
    for _ in range(warmup):
        fn()
        reset()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
        reset()
    return statistics.median(times)
