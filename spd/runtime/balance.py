"""Cost-balanced stage boundaries: time every decoder layer, the embedding and the LM head on this machine, then
cut the layers into n contiguous stages minimising the slowest one. The last stage also runs the head (see
`distributed/controller.py` for why), so on SmolLM2 it gets fewer layers than the others; where the controller
runs stage 1 in its process, stage 1 also carries the controller's share of a step (the drafter, estimated from
the same profile), so it gets fewer too.

Profiles are cached beside the target cache, per thread count, dtype and device: timing costs a full load once.
"""

from __future__ import annotations

import json
import os

import torch

from spd.targets.timing import median_seconds
from spd.targets.stages import StagedTarget


@torch.no_grad()
def profile_costs(staged: StagedTarget, context: int = 64, repeats: int = 15) -> dict:
    """Seconds to decode one token at `context` cached tokens: per layer, the head (norm + LM head), the embedding."""
    device = staged.device
    generator = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(staged.config.vocab_size, (1, context + 1), generator=generator, device=device)
    cache = staged.new_cache()
    final, hidden = staged.forward_all(ids, cache, 0, frozenset(range(staged.num_layers + 1)))
    cache.crop(context)
    position = torch.tensor([context], device=device)
    layer_s = []
    for layer in range(staged.num_layers):
        entering = hidden[layer][:, context:]                                 # [1, 1, d]
        layer_s.append(median_seconds(lambda: staged.run_layers(entering, position, layer, layer + 1, cache),
                                       repeats, device, reset=lambda: cache.crop(context)))
    row = final[0, -1]                                                       # [d]
    token = ids[:, context:]
    return {"layer_s": layer_s, "head_s": median_seconds(lambda: staged.logits(row), repeats, device),
            "embed_s": median_seconds(lambda: staged.embed(token), repeats, device),
            "context": context, "threads": torch.get_num_threads(), "dtype": str(staged.dtype), "device": str(device)}


def controller_costs(costs: dict, module_layers: int, draft_vocab: int | None, vocab: int) -> float:
    """Seconds per step of the controller's own work with a module drafting: its decoder layers cost about a target
    layer each, its head its share of the target's head's rows (draft_vocab None: no module); the embedding."""
    if draft_vocab is None:
        return costs["embed_s"]
    mean_layer = sum(costs["layer_s"]) / len(costs["layer_s"])
    return costs["embed_s"] + module_layers * mean_layer + costs["head_s"] * draft_vocab / vocab


def stage_costs(bounds: list[int], costs: dict, first_extra_s: float = 0.0) -> list[float]:
    """Seconds per step of each stage; the last one includes the head, the first `first_extra_s` (a controller
    running in its process)."""
    out = [sum(costs["layer_s"][a:b]) for a, b in zip(bounds, bounds[1:])]
    out[-1] += costs["head_s"]
    out[0] += first_extra_s
    return out


def balanced_bounds(costs: dict, n: int, first_extra_s: float = 0.0) -> list[int]:
    """Boundaries 0 = b_0 < ... < b_n = L minimising the slowest stage (exact, by dynamic programming); the first
    stage also costs first_extra_s."""
    layer_s, head_s = costs["layer_s"], costs["head_s"]
    num_layers = len(layer_s)
    if not 1 <= n <= num_layers:
        raise ValueError(f"n={n} stages needs 1 <= n <= L={num_layers}")
    prefix = [0.0]
    for c in layer_s:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: the smallest possible slowest stage when the first j layers form k stages (none holds the head)
    best = [[inf] * (num_layers + 1) for _ in range(n + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for k in range(1, n + 1):
        for j in range(k, num_layers + 1):
            for i in range(k - 1, j):
                cost = prefix[j] - prefix[i] + (head_s if k == n and j == num_layers else 0.0) + \
                    (first_extra_s if k == 1 else 0.0)
                value = max(best[k - 1][i], cost)
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds = [num_layers]
    for k in range(n, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def cached_profile(cache_dir: str | None, staged_loader, threads: int, dtype: str, device: str) -> dict:
    """The profile for this thread count/dtype/device, measured (with the full target from `staged_loader()`)
    the first time and kept in cache_dir."""
    path = os.path.join(cache_dir, f"profile-{device}-{dtype}-{threads}t.json") if cache_dir else None
    if path and os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        costs = profile_costs(staged_loader())
    finally:
        torch.set_num_threads(previous)
    if path:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(costs, f)
        os.replace(tmp, path)
    return costs
