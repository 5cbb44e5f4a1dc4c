"""One-token decode steps with fixed shapes, the unit a CUDA graph captures (gpt-fast's recipe).

A `FixedStep` runs layers [start, end) of the target for one token whose position sits in a device tensor: the
token's K/V land at that position of a static cache, attention reads the whole buffer under a mask made from the
position tensor, and nothing is read back to the host. Every call therefore launches the same kernels on the same
memory; on CUDA with `cuda_graph=True` the step is captured once and replayed, which removes the per-kernel launch
cost that bounds a small model at batch 1. Elsewhere the same code runs eagerly: it is what the CPU tests check
against the ordinary (sliced) path, and what a graph replays.

The outputs of a replay live in the graph's own buffers and are overwritten by the next replay, so `__call__`
returns copies.
"""

from __future__ import annotations

import torch

from spd.targets.kv_cache import LayerKVCache
from spd.targets.stages import StagedTarget

WARMUP_RUNS = 2   # eager runs on a side stream before capture (lazy init of kernels and workspaces)


class FixedStep:
    def __init__(self, target: StagedTarget, start: int, end: int, cache: LayerKVCache,
                 capture: frozenset[int] = frozenset(), logits: bool = False, cuda_graph: bool = False):
        if not cache.static:
            raise ValueError("a fixed-shape step needs a static cache (new_cache(max_length=...))")
        self.target, self.start, self.end, self.cache = target, start, end, cache
        self.capture = frozenset(capture)
        self.with_logits = logits
        device = target.device
        self.cuda_graph = cuda_graph and device.type == "cuda"
        self.hidden_in = torch.zeros(1, 1, target.config.hidden_size, device=device, dtype=target.dtype)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.mask_keys = torch.arange(cache.max_length, device=device).view(1, -1)
        self.graph = None
        self._outputs = None

    def _run(self):
        self.cache.write_at = self.position
        try:
            hidden, captured = self.target.run_layers(self.hidden_in, self.position, self.start, self.end,
                                                      self.cache, self.capture, self.mask_keys)
        finally:
            self.cache.write_at = None
        return hidden, captured, self.target.logits(hidden[0, -1]) if self.with_logits else None

    def _capture(self) -> None:
        device = self.target.device     # cuda:N: streams and the capture on that device, not the current one
        with torch.cuda.device(device):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self._run()
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._outputs = self._run()

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, position: int):
        """hidden [1, 1, d] entering layer `start` at `position` -> (H^end [1, 1, d], {l: H^l [1, 1, d]} for captured
        l in (start, end], logits [V] when this step ends the model, else None)."""
        if position >= self.cache.max_length:
            raise ValueError(f"position {position} is past the static cache's max_length={self.cache.max_length}")
        self.hidden_in.copy_(hidden)
        self.position.fill_(position)
        if self.cuda_graph:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            hidden, captured, logits = self._outputs
            hidden, logits = hidden.clone(), None if logits is None else logits.clone()
            captured = {layer: h.clone() for layer, h in captured.items()}
        else:
            hidden, captured, logits = self._run()
        self.cache.written(range(self.start, self.end), position + 1)   # what an eager step appends after
        return hidden, captured, logits
