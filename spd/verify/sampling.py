"""Sampling and verification rules. The same `warp` shapes the target's p and the drafter's q, so that
rejection sampling preserves the target's (warped) distribution exactly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


BLOCK = 64     # a CPU's argmax and top-k over a vocabulary run ~5x slower than its max: read block maxima first
FEWEST = 64 * BLOCK     # under this many logits torch's own argmax and top-k cost little


def blocks_of(logits: torch.Tensor) -> torch.Tensor | None:
    """logits [..., V] as [..., V / BLOCK, BLOCK] where that view exists and pays (a large CPU vocabulary), else
    None."""
    vocab = logits.shape[-1]
    if logits.device.type != "cpu" or vocab < FEWEST or vocab % BLOCK or not logits.is_contiguous():
        return None
    return logits.view(*logits.shape[:-1], -1, BLOCK)


def top2_margin(logits: torch.Tensor) -> float:
    """The gap between the two largest logits [V]: how sure the target was where it chose a token."""
    x = logits.float()
    blocks = blocks_of(x) if x.dim() == 1 else None
    if blocks is None:
        top = torch.topk(x, 2).values
        return float(top[0] - top[1])
    # the runner-up is the best block's second value or the second block's best: the same two values topk finds
    best = torch.topk(blocks.amax(1), 2)
    inside = torch.topk(blocks[best.indices[0]], 2).values
    return float(inside[0] - torch.maximum(inside[1], best.values[1]))


def greedy_token(logits: torch.Tensor) -> int:
    """Argmax over [V]; ties go to the lowest id, identically for AR and SPD."""
    blocks = blocks_of(logits) if logits.dim() == 1 else None
    if blocks is None:
        return int(torch.argmax(logits))
    block = int(torch.argmax(blocks.amax(1)))     # the first block holding the maximum, then its first place
    return block * BLOCK + int(torch.argmax(blocks[block]))


def kth_largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest value of x [V] (torch.topk's): on a large CPU vocabulary, among the k blocks with the largest
    maxima — a value at or above it outside them would put k block maxima above it too."""
    blocks = blocks_of(x)
    if blocks is None or k > blocks.shape[0]:
        return torch.topk(x, k).values[-1]
    best = torch.topk(blocks.amax(1), k).indices                      # [k]
    return torch.topk(blocks[best].flatten(), k).values[-1]


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] -> probabilities [V] after temperature, top-k, then top-p (nucleus)."""
    x = logits.float()
    if params.temperature != 1:          # x / 1 is x, bit for bit
        x = x / params.temperature
    if params.top_k and params.top_k < x.numel():
        x = torch.where(x < kth_largest(x, params.top_k), float("-inf"), x)
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = mass_before >= params.top_p  # keeps the smallest prefix whose mass reaches top_p (at least one)
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


class KeyedDraws:
    """One request's sampled draws by the Gumbel-max rule: the token at position t is argmax over warp's support of
    log p(x) + g_t(x), with g_t = -log(-log u_t) and u_t [V] uniforms drawn from a generator seeded by (the request's
    key, t) alone. Every x then comes out with exactly its p, and the noise of a position is known before the target
    has read it: a drafter may look at it (a deterministic candidate whose noise is high is likelier to be the
    draw), and it changes nothing, since the token at t is a function of the prefix and u_t only. So a seeded
    request samples the same text whether it is decoded one token a forward (AR) or by draft-then-verify at any
    width and any drafts (spd.runtime.sequence); the pipelines, whose drafts carry a q, keep rejection sampling."""

    KEEP = 64                  # positions whose uniforms stay cached (a draft looks at most a tree's depth ahead)

    def __init__(self, key: int, vocab: int):
        self.key, self.vocab = key, vocab
        self.cache: dict[int, torch.Tensor] = {}
        self.drawn: dict[int, float] = {}   # position -> the target's p of the token drawn there (read by drafters)

    @classmethod
    def of(cls, generator: torch.Generator, vocab: int) -> "KeyedDraws":
        """The request's key: the first draw of its own generator (so a seed fixes it, and no seed leaves it free)."""
        return cls(int(torch.randint(0, 2 ** 62, (), generator=generator)), vocab)

    def uniforms(self, position: int) -> torch.Tensor:
        """u_position [V] (float64, on the CPU)."""
        u = self.cache.get(position)
        if u is None:
            if len(self.cache) >= self.KEEP:
                del self.cache[min(self.cache)]
            u = self.cache[position] = keyed_uniforms(torch.tensor(self.key), torch.tensor([position]), self.vocab)[0]
        return u

    def uniform(self, position: int, token: int) -> float:
        return float(self.uniforms(position)[token])

    def sample(self, probs: torch.Tensor, position: int) -> int:
        """The draw at `position` from probs [V] (warp's output), recorded as drawn there."""
        token, self.drawn[position] = self.draw(probs, position)
        return token

    def draw(self, probs: torch.Tensor, position: int) -> tuple[int, float]:
        """The draw at `position` from probs [V] and its p, not recorded (a row off the verified path draws too)."""
        support = probs.nonzero().squeeze(1)                              # [S]
        held = self.cache.get(position)
        u = (held[support.cpu()] if held is not None else              # the support's uniforms alone: ~50 of 49k
             host_uniforms(self.key, position, support.cpu()))
        u = u.to(probs.device)
        p = probs[support].double()                                       # [S]
        best = int(torch.argmax(torch.log(p) - torch.log(-torch.log(u))))   # log p + Gumbel noise
        return int(support[best]), float(p[best])

    def chance(self, position: int) -> float:
        """The target's (warped) p of the token drawn at `position`, NaN where nothing was drawn: how sure the target
        was of what it sampled there, which a drafter proposing that token again after the same context may read."""
        return self.drawn.get(position, float("nan"))


def _signed(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with its bits (tensors hold int64; + and * wrap the same way)."""
    return x - (1 << 64) if x >= 1 << 63 else x


GAMMA = _signed(0x9E3779B97F4A7C15)     # SplitMix64's increment and multipliers
MIX1, MIX2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x >> bits as an unsigned 64-bit shift (torch shifts int64 arithmetically: the sign bits are masked off)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (the uint64 bits): nearby inputs give unrelated outputs."""
    x = (x ^ _shift(x, 30)) * MIX1
    x = (x ^ _shift(x, 27)) * MIX2
    return x ^ _shift(x, 31)


def keyed_uniforms(key: torch.Tensor, positions: torch.Tensor, vocab: int,
                   tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The uniforms u_t [len(positions), vocab] (float64 in [0, 1)) of a request's `key` [] (int64) at `positions`
    [r] (int64), a counter-based hash of (key, t, token) alone: SplitMix64 seeded by mix(key ^ mix(t)), its i-th
    output's top 53 bits for token i. Tensor ops only, so a device step computes in place the bits the host draws
    (no copy a step), and a draw never depends on which positions were drawn before it. With `tokens` [k] (int64),
    only theirs, [r, k]: the same values (a sampled draw reads its top-k support's, not the vocabulary's)."""
    seed = _mix((key ^ _mix(positions + GAMMA)) + GAMMA)                              # [r]
    index = (torch.arange(vocab, device=positions.device, dtype=torch.int64) if tokens is None
             else tokens.to(positions.device, torch.int64)) + 1                      # [V] or [k]
    state = seed.view(-1, 1) + index.view(1, -1) * GAMMA                             # [r, V]
    return _shift(_mix(state), 11).double() * 2.0 ** -53


MASK = (1 << 64) - 1


def _mix_int(x: int) -> int:
    """_mix on one Python int (its low 64 bits)."""
    x &= MASK
    x = ((x ^ (x >> 30)) * (MIX1 & MASK)) & MASK
    x = ((x ^ (x >> 27)) * (MIX2 & MASK)) & MASK
    return x ^ (x >> 31)


def host_uniforms(key: int, position: int, tokens: torch.Tensor) -> torch.Tensor:
    """keyed_uniforms(key, [position], V, tokens)[0] [k] on the host, in NumPy's unsigned 64-bit arithmetic: the same
    bits (the hash wraps the same way), a few array operations instead of ~30 tensor ones for a support of ~50."""
    seed = _mix_int(((key & MASK) ^ _mix_int(position + GAMMA)) + GAMMA)
    u64 = np.uint64
    with np.errstate(over="ignore"):
        x = u64(seed & MASK) + (tokens.numpy().astype(u64) + u64(1)) * u64(GAMMA & MASK)        # [k]
        x = (x ^ (x >> u64(30))) * u64(MIX1 & MASK)
        x = (x ^ (x >> u64(27))) * u64(MIX2 & MASK)
        x = x ^ (x >> u64(31))
    return torch.from_numpy((x >> u64(11)).astype(np.float64) * 2.0 ** -53)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
               draws: KeyedDraws | None = None, position: int = 0) -> int:
    """The target's own choice at `position`: argmax when greedy, else a sample from warp(logits) — the keyed
    draw there when the request has `draws`, else one from the generator."""
    if params.greedy:
        return greedy_token(logits)
    probs = warp(logits, params)
    return draws.sample(probs, position) if draws is not None else sample(probs, generator)


def verify_greedy(draft: int, target_logits: torch.Tensor | int) -> tuple[bool, int]:
    """Accept iff the draft is the target's argmax (given as logits [V], or already taken where the head ran);
    either way return the token that position settles to."""
    best = target_logits if isinstance(target_logits, int) else greedy_token(target_logits)
    return draft == best, best


def verify_sampled(draft: int, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None) -> tuple[bool, int]:
    """Speculative rejection sampling: accept x~q with prob min(1, p(x)/q(x)), else draw from norm(max(0, p-q))."""
    ratio = p[draft] / q[draft]
    u = torch.rand((), generator=generator, device=p.device)
    if u < ratio:
        return True, draft
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    if total <= 0:  # p == q up to rounding: rejection had probability ~0, fall back to p itself
        residual, total = p, p.sum()
    return False, sample(residual / total, generator)


def verify_point_mass(draft: int, p: torch.Tensor, generator: torch.Generator | None) -> tuple[bool, int]:
    """A deterministic draft (q = the point mass at x, e.g. a context lookup): accept with probability p(x), else
    draw from the residual norm(max(0, p - q)), which is p without x. Same rule as `verify_sampled` with that q."""
    u = torch.rand((), generator=generator, device=p.device)
    if u < p[draft]:
        return True, draft
    residual = p.clone()
    residual[draft] = 0
    total = residual.sum()
    if total <= 0:  # p is the point mass at x up to rounding: acceptance had probability ~1
        return True, draft
    return False, sample(residual / total, generator)


class Proposal(NamedTuple):
    """A drafted token and the warped q it was sampled from; q None for a deterministic draft (greedy argmax, a
    context lookup), which sampled verification treats as a point mass. `source` names where it came from
    ("module", "lookup", ...) so acceptance can be counted per draft source."""

    token: int
    q: torch.Tensor | None = None
    source: str = "module"


def propose(draft_logits: torch.Tensor, params: SamplingParams, generator) -> Proposal:
    """A drafter's token from its logits [V] and, when sampling, the warped q it was drawn from."""
    if params.greedy:
        return Proposal(greedy_token(draft_logits))
    q = warp(draft_logits, params)
    return Proposal(sample(q, generator), q)


def propose_children(draft_logits: torch.Tensor, width: int) -> list[tuple[Proposal, float]]:
    """A tree node's children (W > 1): the drafter's `width` likeliest tokens from its logits [V], deterministic
    (q = None: verified by one draw of p, `settle_children`), each with its log q to rank branches by."""
    return children_of_rows(draft_logits.unsqueeze(0), width)[0]


def children_of_rows(draft_logits: torch.Tensor, width: int) -> list[list[tuple[Proposal, float]]]:
    """`propose_children` for every row of draft_logits [S, V] (a tree level's nodes drafted in one pass)."""
    log_q = torch.log_softmax(draft_logits.float(), -1)
    top = torch.topk(log_q, width, dim=-1)
    return [[(Proposal(token), lp) for lp, token in zip(values, indices) if lp > float("-inf")]
            for values, indices in zip(top.values.tolist(), top.indices.tolist())]


def settle(target_logits: torch.Tensor | int, draft: int, q: torch.Tensor | None, params: SamplingParams,
           generator) -> tuple[bool, int]:
    """Verify a draft against the target's logits [V] for its position (greedy: or their argmax); return
    (accepted, settled token)."""
    if params.greedy:
        return verify_greedy(draft, target_logits)
    p = warp(target_logits, params)
    return verify_point_mass(draft, p, generator) if q is None else verify_sampled(draft, p, q, generator)


def settle_children(target_logits: torch.Tensor | int, children: list[Proposal], params: SamplingParams,
                    generator, draws: KeyedDraws | None = None, position: int = 0) -> tuple[int | None, int]:
    """Verify a draft-tree node's children against the target's logits [V] at the node (design §8): return (the
    index of the child to descend into, or None, and the token the next position settles to).

    One child is a chain's draft (`settle`, bit for bit). Several deterministic children (top-k, lookup
    candidates): one draw x from the warped p; descend into x if it is a child, else x is emitted — each child is
    kept with exactly its p. Children drawn from q (each independently from its own): recursive rejection
    sampling — accept x_i with min(1, r_i(x_i)/q_i(x_i)), else r_{i+1} = norm(max(r_i - q_i, 0)) — with a
    deterministic child as the point mass it is. Either way the token that comes out is distributed as p. With
    `draws` (a keyed request) deterministic children are settled by the keyed draw at `position`: x is the token AR
    samples there, and the node descends into x if it is a child."""
    if draws is not None and not params.greedy and all(c.q is None for c in children):
        x = draws.sample(warp(target_logits, params), position)
        tokens = [c.token for c in children]
        return (tokens.index(x) if x in tokens else None), x
    if len(children) == 1:
        ok, token = settle(target_logits, children[0].token, children[0].q, params, generator)
        return (0 if ok else None), token
    tokens = [c.token for c in children]
    if params.greedy:
        best = target_logits if isinstance(target_logits, int) else greedy_token(target_logits)
        return (tokens.index(best) if best in tokens else None), best
    p = warp(target_logits, params)
    if all(c.q is None for c in children):
        x = sample(p, generator)
        return (tokens.index(x) if x in tokens else None), x
    residual = p
    for i, child in enumerate(children):
        q = child.q if child.q is not None else _point_mass(child.token, p)
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[child.token] < residual[child.token]:        # strict: a token with r = 0 is never kept
            return i, child.token
        rest = (residual - q).clamp(min=0)
        total = rest.sum()
        if total <= 0:       # r <= q everywhere up to rounding: rejection had probability ~0
            return i, child.token
        residual = rest / total
    return None, sample(residual, generator)


def _point_mass(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q
