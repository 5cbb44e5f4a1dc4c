"""The single source of truth for *which feature each position gets*.

Both the runtime's row builder and the trainer's structural mask call `depth` — the rule k(t, i, a) of
design §1 — and `feature_layers`, so training optimises exactly the function decoding runs.

Positions are 0-indexed. `t` is the position of the token about to enter stage 1, `a` the pipeline
occupancy counting that token (1 <= a <= n).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from spd.methods import METHODS


def depth(t: int, i: int, a: int, n: int, shift: int = 0) -> int:
    """Depth of the feature position i contributes when the step for position t begins with occupancy a.

    shift=1 reads the step's *outputs* instead (the output-state ablation): every in-flight token one stage deeper."""
    if i > t:
        raise ValueError(f"position {i} is in the future of step position {t}")
    return min(n, t - i + shift) if t - i < a else n


def depth_grid(n_pos: int, occupancy: torch.Tensor, n: int, shift: int = 0) -> torch.Tensor:
    """k(t, i, a) for every (query t, key i) at once, -1 where i > t. Vectorised twin of `depth`, tested against it.

    occupancy: [B] ints in 1..n.  Returns [B, n_pos, n_pos] long (query t on dim 1, key i on dim 2).
    """
    t = torch.arange(n_pos, device=occupancy.device).view(1, n_pos, 1)
    i = torch.arange(n_pos, device=occupancy.device).view(1, 1, n_pos)
    lag = (t - i).expand(occupancy.shape[0], n_pos, n_pos)  # [B, N, N]
    a = occupancy.view(-1, 1, 1)
    grid = torch.where(lag < a, (lag + shift).clamp(max=n), torch.full_like(lag, n))
    return torch.where(lag < 0, torch.full_like(grid, -1), grid)


def stage_bounds(num_layers: int, n: int, explicit: list[int] | None = None) -> list[int]:
    """Boundaries 0 = b_0 < b_1 < ... < b_n = L. Near-even split unless `explicit` gives b_1..b_{n-1} or b_0..b_n."""
    if explicit:
        b = list(explicit)
        if len(b) == n - 1:
            b = [0, *b, num_layers]
        if len(b) != n + 1 or b[0] != 0 or b[-1] != num_layers or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(
                f"stage_bounds={explicit} must be {n - 1} increasing inner boundaries (or 0..{num_layers} with "
                f"{n + 1} entries) for n={n}, L={num_layers}"
            )
        return b
    if not 1 <= n <= num_layers:
        raise ValueError(f"n={n} stages needs 1 <= n <= L={num_layers}")
    base, extra = divmod(num_layers, n)
    # The first `extra` stages take one more layer; a step costs the largest stage either way.
    sizes = [base + (1 if s < extra else 0) for s in range(n)]
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def mid_layer(b: int) -> int:
    """m_k = round(b_k / 2), halves rounded up (b=3 -> 2, b=9 -> 5), so it never collapses onto H^0 for b >= 1."""
    return (b + 1) // 2


def feature_layers(bounds: list[int]) -> list[tuple[int, ...]]:
    """Layers whose hidden states (pre final norm) make g^k: (0,) for k=0, (0, m_k, b_k) for k >= 1."""
    return [(0,)] + [(0, mid_layer(b), b) for b in bounds[1:]]


def needed_layers(bounds: list[int]) -> list[int]:
    """Every layer index any depth's feature reads, sorted."""
    return sorted({layer for layers in feature_layers(bounds) for layer in layers})


def sample_occupancy(batch: int, n: int, generator: torch.Generator | None = None, p_full: float = 0.5,
                     weights: list[float] | None = None) -> torch.Tensor:
    """The paper's simulated fill (App. A.2): a = n with probability p_full, else uniform on 1..n-1. [B] long.

    `weights` (P(a=1..n)) replaces that policy, e.g. with the occupancy distribution a decoder actually visits.
    """
    if weights is not None:
        w = torch.tensor(weights, dtype=torch.float)
        if w.numel() != n or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"occupancy weights need {n} non-negative entries with a positive sum, got {weights}")
        return torch.multinomial(w, batch, replacement=True, generator=generator) + 1
    full = torch.rand(batch, generator=generator) < p_full
    if n == 1:
        return torch.ones(batch, dtype=torch.long)
    partial = torch.randint(1, n, (batch,), generator=generator)
    return torch.where(full, torch.full_like(partial, n), partial)


# ---------------------------------------------------------------- pipelined drafters
@dataclass(frozen=True)
class FeaturePlan:
    """What a pipelined drafter reads and when it runs: SPD (input states, concurrent with the step), its
    output-state ablation (paper Table 2) and PPSD. The module, the trainer's mask, the runtime's row builder and
    the fast evaluator all take depths from here."""

    method: str
    shift: int             # an in-flight token j positions behind the newest has depth j + shift (capped at n)
    single: int | None     # every position reads this one depth instead (PPSD: 1, the stage-1 output)
    after_step: bool       # the drafter runs after the step, on what it produced: its time adds to every step

    def depth(self, t: int, i: int, a: int, n: int) -> int:
        if self.single is not None:
            if i > t:
                raise ValueError(f"position {i} is in the future of step position {t}")
            return self.single
        return depth(t, i, a, n, self.shift)

    def depth_grid(self, n_pos: int, occupancy: torch.Tensor, n: int) -> torch.Tensor:
        grid = depth_grid(n_pos, occupancy, n, self.shift)
        return grid if self.single is None else torch.where(grid < 0, grid, torch.full_like(grid, self.single))

    def query_depth(self) -> int:
        """Depth of the newest token's row (the query)."""
        return self.shift if self.single is None else self.single

    def memory_depth(self, n: int) -> int:
        """Depth of every position that has left the pipeline (the rows a drafter may cache)."""
        return n if self.single is None else self.single

    def lag_depths(self, n: int) -> dict[int, int]:
        """{lag j: depth} of the in-flight rows whose depth differs from the memory depth (when j < a)."""
        if self.single is not None:
            return {}
        return {j: j + self.shift for j in range(1, n) if j + self.shift < n}

    def depths(self, n: int) -> list[int]:
        """Every depth this plan reads, hence one FC each."""
        return [self.single] if self.single is not None else list(range(self.shift, n + 1))

    def feature_layers(self, bounds: list[int]) -> dict[int, tuple[int, ...]]:
        """{depth k: the layers g^k reads}. PPSD reads the stage-1 output H^{b_1} alone."""
        if self.single is not None:
            return {self.single: (bounds[self.single],)}
        every = feature_layers(bounds)
        return {k: every[k] for k in self.depths(len(bounds) - 1)}

    def needed_layers(self, bounds: list[int]) -> list[int]:
        return sorted({layer for layers in self.feature_layers(bounds).values() for layer in layers})


# every pipelined method's plan, from its registry entry (spd.methods)
PLANS = {name: FeaturePlan(name, **dataclasses.asdict(m.plan)) for name, m in METHODS.items() if m.plan is not None}


def plan_for(method: str) -> FeaturePlan:
    if method not in PLANS:
        raise ValueError(f"method {method!r} is not a pipelined drafter; choose from {', '.join(PLANS)}")
    return PLANS[method]
