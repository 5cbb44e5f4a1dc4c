"""The target's own greedy decodes, cached: what the exact fast evaluator replays and what greedy SPD must equal.

One directory per (target weights, stored layers, dtype, device type, max_new_tokens); one file per prompt inside
it, written atomically and holding the prompt's token ids. A layout's own directory stores the layers its features
read; `extra_layers` makes one that several layouts and EAGLE-3 share (found by its layers). An interrupted recording resumes where it stopped, a
subset (`limit=`) reuses the full set's files, a changed prompt is re-recorded, and a change to the target or the
settings lands in a new directory (the old one is never reused by mistake). A longer recording serves a shorter run:
greedy decoding is incremental, so the first N tokens of a 512-token decode, their margins and the states fed before
them are an N-token decode's (prompts it lacks are recorded at its own length, so a directory holds one length).
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import torch

from spd.decoding import eos_ids_of
from spd.eval.fast import GreedyTrace, record_greedy_trace, record_greedy_traces
from spd.layout import needed_layers
from spd.targets.loading import LoadedTarget
from spd.targets.stages import StagedTarget


def trace_key(fingerprint: str, bounds: list[int], dtype: torch.dtype, device: torch.device,
              max_new_tokens: int, layers: list[int] | None = None) -> str:
    """layers: the stored H^l when they are not the layout's own (a set shared by several layouts or methods)."""
    payload = {"target": fingerprint, "bounds": list(bounds), "dtype": str(dtype), "device": torch.device(device).type,
               "max_new_tokens": max_new_tokens}
    if layers is not None and sorted(layers) != needed_layers(bounds):
        payload["bounds"] = None
        payload["layers"] = sorted(layers)
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


def find_shared(root: str, fingerprint: str, dtype: torch.dtype, device: torch.device, max_new_tokens: int,
                layers: list[int]) -> str | None:
    """A directory of traces of the same target and settings that stores every layer in `layers`, recorded for
    max_new_tokens or (the shortest of) more. The target's greedy decode and its hidden states do not depend on how
    it is split, so one recording serves any layout (and EAGLE-3) whose layers it holds."""
    if not os.path.isdir(root):
        return None
    found = []
    for name in sorted(os.listdir(root)):
        try:
            with open(os.path.join(root, name, "meta.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            continue
        if (meta.get("layers") is not None and meta.get("device") == torch.device(device).type
                and meta["fingerprint"] == fingerprint and meta["dtype"] == str(dtype)
                and meta["max_new_tokens"] >= max_new_tokens and set(layers) <= set(meta["layers"])):
            found.append((meta["max_new_tokens"], name))
    return os.path.join(root, min(found)[1]) if found else None


class TraceCache:
    """Greedy traces per (dataset, question_id), recorded on first use.

    layers: the H^l a run reads (default: what the layout's features read); extra_layers: stored as well when a new
    directory is made, so that runs at other n, or EAGLE-3, reuse the same recordings."""

    def __init__(self, root: str, loaded: LoadedTarget, staged: StagedTarget, max_new_tokens: int,
                 layers: list[int] | None = None, extra_layers: list[int] = ()):
        self.staged, self.max_new_tokens = staged, max_new_tokens
        self.eos = eos_ids_of(loaded.model.config, loaded.tokenizer)
        self.layers = sorted(layers) if layers is not None else needed_layers(staged.bounds)
        outside = [l for l in [*self.layers, *extra_layers] if not 0 <= l <= staged.num_layers]
        if outside:
            raise ValueError(f"trace layers {outside} are outside 0..{staged.num_layers}")
        stored = sorted({*self.layers, *extra_layers})
        self.key = trace_key(loaded.fingerprint, staged.bounds, staged.dtype, staged.device, max_new_tokens, stored)
        self.directory = os.path.join(root, f"greedy-{self.key}")
        if not os.path.exists(os.path.join(self.directory, "meta.json")):
            self.directory = find_shared(root, loaded.fingerprint, staged.dtype, staged.device, max_new_tokens,
                                         self.layers) or self.directory
        os.makedirs(self.directory, exist_ok=True)
        meta = os.path.join(self.directory, "meta.json")
        if not os.path.exists(meta):
            with open(meta + ".tmp", "w") as f:
                json.dump({"target": loaded.name, "fingerprint": loaded.fingerprint, "bounds": staged.bounds,
                           "layers": stored, "device": staged.device.type, "dtype": str(staged.dtype),
                           "max_new_tokens": max_new_tokens}, f)
            os.replace(meta + ".tmp", meta)
        with open(meta) as f:
            saved = json.load(f)
        # recordings go in with every layer of the directory they join (older ones: their layout's), at its length
        self.stored = saved.get("layers") or needed_layers(saved["bounds"])
        self.recorded_tokens = saved["max_new_tokens"]

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
                trace = GreedyTrace(raw["prompt_ids"], raw["tokens"], self._read(raw["hidden"]), raw["margins"])
                return self._cut(trace), {"seconds": raw["seconds"], "recorded_now": False}
        start = time.perf_counter()
        trace = record_greedy_trace(self.staged, list(prompt_ids), self.recorded_tokens, self.eos, self.stored)
        seconds = time.perf_counter() - start
        self._write(path, trace, seconds)
        trace.hidden = self._read(trace.hidden)
        longer = len(trace.tokens) > self.max_new_tokens     # its time is a longer decode's: no speed to report
        return self._cut(trace), {"seconds": seconds, "recorded_now": not longer}

    def _cut(self, trace: GreedyTrace) -> GreedyTrace:
        """The first max_new_tokens of a longer recording: the tokens, their margins, the states fed before them."""
        keep = self.max_new_tokens
        if len(trace.tokens) <= keep:
            return trace
        fed = len(trace.prompt_ids) + keep - 1
        return GreedyTrace(trace.prompt_ids, trace.tokens[:keep], {layer: h[:, :fed] for layer, h in trace.hidden.items()},
                           trace.margins[:keep])

    def record_missing(self, items: list[tuple[str, object, list[int]]], batch_size: int, progress=None) -> int:
        """Record the traces of (dataset, question_id, prompt_ids) not on disk yet, batch_size prompts per forward;
        returns how many. Their times are shared with the batch, so `get` reports no one-sequence speed for them.
        progress(): called once per trace written."""
        missing = [item for item in items if not self.has(item[0], item[1])]
        for index, trace, seconds in record_greedy_traces(self.staged, [list(ids) for _, _, ids in missing],
                                                          self.recorded_tokens, self.eos, self.stored, batch_size):
            dataset, question_id, _ = missing[index]
            self._write(self._path(dataset, question_id), trace, seconds, batch_size)
            if progress:
                progress()
        return len(missing)

    @staticmethod
    def _write(path: str, trace: GreedyTrace, seconds: float, batch_size: int = 1) -> None:
        torch.save({"prompt_ids": trace.prompt_ids, "tokens": trace.tokens, "hidden": trace.hidden,
                    "margins": trace.margins, "seconds": seconds, "batch_size": batch_size}, path + ".tmp")
        os.replace(path + ".tmp", path)

    def _read(self, hidden: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return {layer: hidden[layer] for layer in self.layers}
