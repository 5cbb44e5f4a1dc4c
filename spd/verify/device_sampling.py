"""The sampling rule as device tensors, for a step that runs whole on the device (spd.runtime.device_step,
spd.runtime.device_pipeline): a request's settings held in tensors (`DeviceSampling`), so a step built for one
setting serves every other; the target's choice after each row (`choose`: argmax, or the keyed Gumbel-max draw over
warp's support); the keyed noise computed from a position tensor (`gumbel`). Bit for bit the host's rule
(spd.verify.sampling: `warp`, `KeyedDraws`), so a device step's tokens are the host loop's."""

from __future__ import annotations

import torch

from spd.verify.sampling import SamplingParams, keyed_uniforms, warp


def gumbel(key: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The keyed Gumbel noise -log(-log u) [r, V] (float64) of the request's `key` [] at `positions` [r], computed
    where they are (spd.verify.sampling.keyed_uniforms): inside a step, from its position tensor, the bits
    KeyedDraws.sample adds to log p there, and nothing copied to the device a step."""
    return -torch.log(-torch.log(keyed_uniforms(key, positions, vocab)))


class DeviceSampling:
    """A request's sampling settings as device tensors, so that a step built (captured, compiled) for one setting
    serves every other: a new request refills them (`set`); only greedy against sampled is another step."""

    def __init__(self, device: torch.device, params: SamplingParams):
        self.greedy = params.greedy
        # float32, as warp's Python scalars act on float32 logits: the same roundings, the same bits
        self.temperature = torch.ones((), device=device)                               # []
        self.top_k = torch.zeros((), dtype=torch.long, device=device)                  # []
        self.top_p = torch.ones((), device=device)                                     # []
        self.set(params)

    def set(self, params: SamplingParams) -> None:
        if params.greedy != self.greedy:
            raise ValueError("a greedy step cannot sample (nor a sampling one decode greedily): build another")
        if not params.greedy:
            self.temperature.fill_(params.temperature)
            self.top_k.fill_(params.top_k)
            self.top_p.fill_(params.top_p)

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [r, V] -> probabilities [r, V]: spd.verify.sampling.warp of each row with the settings read from
        tensors, bit for bit (top-k's threshold is the k-th value of the sorted row; an off filter keeps every
        logit). All rows at once: a tree's 16 rows are two sorts, not 32."""
        x = logits.float() / self.temperature                                         # [r, V]
        rows, vocab = x.shape
        kth = torch.sort(x, descending=True).values.gather(
            -1, (self.top_k - 1).clamp(0, vocab - 1).expand(rows, 1))                 # [r, 1]
        x = x.masked_fill((self.top_k > 0) & (self.top_k < vocab) & (x < kth), float("-inf"))
        sorted_x, order = torch.sort(x, descending=True)                               # [r, V]
        probs = torch.softmax(sorted_x, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs >= self.top_p) & (self.top_p < 1.0)
        return torch.softmax(x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf"))), dim=-1)


def choose(logits: torch.Tensor, params: SamplingParams | DeviceSampling, noise: torch.Tensor | None) -> torch.Tensor:
    """logits [r, V] -> the target's token after each row [r]: its argmax (ties to the lowest id, as
    spd.verify.sampling.greedy_token), or the keyed draw argmax(log p + g) over warp's support (KeyedDraws.sample), with
    g the rows' noise [>= r, V]."""
    if params.greedy:
        return logits.argmax(-1)
    probs = params.warp(logits) if isinstance(params, DeviceSampling) else \
        torch.stack([warp(row, params) for row in logits.unbind(0)])
    probs = probs.double()                                                             # [r, V]
    return first_max(torch.where(probs > 0, probs.log() + noise[: len(logits)], float("-inf")))


def first_max(x: torch.Tensor) -> torch.Tensor:
    """x [r, V] -> the lowest index of each row's maximum [r]: argmax's answer, as a max and then a min. Inductor
    (torch 2.13.0, CPU) miscompiles a vectorised argmax over the keyed noise's 64-bit integer hash (a crash, or
    tokens outside the vocabulary); these two reductions compile right, vectorised."""
    top = x.max(-1, keepdim=True).values                                               # [r, 1]
    index = torch.arange(x.shape[-1], device=x.device)                                 # [V]
    return torch.where(x == top, index, x.shape[-1]).min(-1).values
