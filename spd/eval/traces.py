"""The target's own greedy decodes, cached: what the exact fast evaluator replays and what greedy SPD must equal.

One directory per (target weights, stage bounds, dtype, device type, max_new_tokens); one file per prompt inside
it, written atomically and holding the prompt's token ids. An interrupted recording resumes where it stopped, a
subset (`limit=`) reuses the full set's files, a changed prompt is re-recorded, and a change to the target or the
settings lands in a new directory (the old one is never reused by mistake).
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import torch

from spd.decoding import eos_ids_of
from spd.fast_eval import GreedyTrace, record_greedy_trace
from spd.target.loading import LoadedTarget
from spd.target.stages import StagedTarget


def trace_key(fingerprint: str, bounds: list[int], dtype: torch.dtype, device: torch.device,
              max_new_tokens: int) -> str:
    payload = {"target": fingerprint, "bounds": list(bounds), "dtype": str(dtype), "device": torch.device(device).type,
               "max_new_tokens": max_new_tokens}
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


class TraceCache:
    """Greedy traces per (dataset, question_id), recorded on first use."""

    def __init__(self, root: str, loaded: LoadedTarget, staged: StagedTarget, max_new_tokens: int):
        self.staged, self.max_new_tokens = staged, max_new_tokens
        self.eos = eos_ids_of(loaded.model.config, loaded.tokenizer)
        self.key = trace_key(loaded.fingerprint, staged.bounds, staged.dtype, staged.device, max_new_tokens)
        self.directory = os.path.join(root, f"greedy-{self.key}")
        os.makedirs(self.directory, exist_ok=True)
        meta = os.path.join(self.directory, "meta.json")
        if not os.path.exists(meta):
            with open(meta + ".tmp", "w") as f:
                json.dump({"target": loaded.name, "fingerprint": loaded.fingerprint, "bounds": staged.bounds,
                           "dtype": str(staged.dtype), "max_new_tokens": max_new_tokens}, f)
            os.replace(meta + ".tmp", meta)

    def _path(self, dataset: str, question_id) -> str:
        return os.path.join(self.directory, f"{dataset}-{question_id}.pt")

    def has(self, dataset: str, question_id) -> bool:
        return os.path.exists(self._path(dataset, question_id))

    def get(self, dataset: str, question_id, prompt_ids: list[int]) -> tuple[GreedyTrace, dict]:
        """(trace, info); info holds the recording's wall time and whether it was recorded just now."""
        path = self._path(dataset, question_id)
        if os.path.exists(path):
            raw = torch.load(path, map_location=self.staged.device)
            if raw["prompt_ids"] == list(prompt_ids):
                trace = GreedyTrace(raw["prompt_ids"], raw["tokens"], raw["hidden"], raw["margins"])
                return trace, {"seconds": raw["seconds"], "recorded_now": False}
        start = time.perf_counter()
        trace = record_greedy_trace(self.staged, list(prompt_ids), self.max_new_tokens, self.eos)
        seconds = time.perf_counter() - start
        torch.save({"prompt_ids": trace.prompt_ids, "tokens": trace.tokens, "hidden": trace.hidden,
                    "margins": trace.margins, "seconds": seconds}, path + ".tmp")
        os.replace(path + ".tmp", path)
        return trace, {"seconds": seconds, "recorded_now": True}
