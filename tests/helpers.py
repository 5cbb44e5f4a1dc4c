"""Small builders shared by tests."""

import importlib.util
import os

import torch

from spd.runtime.ar import ARDecoder
from spd.decoding import Request
from spd.drafters.base import Drafter, WrappedDrafter
from spd.drafters.spd_module import ModuleDrafter
from spd.models.module import SpeculationModule
from spd.runtime.pipeline import PipelineDecoder
from spd.verify.sampling import SamplingParams
from spd.targets.stages import StagedTarget

GREEDY = SamplingParams()


def distributed_runtime(**overrides):
    """runtime=distributed's options as `open_stages` takes them (spd.spec.RuntimeOptions): one thread per stage
    process, on this machine."""
    from spd.spec import DistributedOptions, RuntimeOptions

    distributed = dict(threads_per_stage=1, controller="auto", master_addr="127.0.0.1", master_port=0, timeout_s=20.0)
    distributed.update({k: v for k, v in overrides.items() if k in distributed})
    return RuntimeOptions(name="distributed", device="cpu", dtype="float32", weights="float32", cuda_graphs=False,
                          compile=False, distributed=DistributedOptions(**distributed))


def ended_on_rejection(result) -> bool:
    """The last settled token was a correction (a generation ends only at a settle, or after the first token)."""
    s = result.stats
    return s.rollbacks > 0 and s.accepted_runs[-1] == 0 and s.N > 1


def controller_parts(spec: str, n: int):
    """What the controller process holds: the embedding and head, no decoder layer; and the cache it loads from."""
    from spd.targets.weight_cache import load_parts, materialize

    cache = materialize(spec)
    parts = load_parts(cache, range(0), embed=True, head=True, dtype=torch.float32)
    return StagedTarget(parts.model, n), cache


def prompt(seed: int, length: int = 12, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab - 1, (length,), generator=g).tolist()


def spd_run(model, n, prompt_ids, max_new, module_layers=1, use_cache=True, draft_vocab=None, params=GREEDY,
            eos=frozenset(), seed=0, method="spd"):
    staged = StagedTarget(model, n)
    module = SpeculationModule.from_target(staged, module_layers, draft_to_target=draft_vocab, seed=seed,
                                           method=method)
    decoder = PipelineDecoder(staged, ModuleDrafter(module, use_cache), eos)
    return decoder.generate(prompt_ids, Request(max_new, params)), staged, module


def ar_run(model, prompt_ids, max_new, params=GREEDY, eos=frozenset(), seed=None):
    return ARDecoder(StagedTarget(model, 1), eos).generate(prompt_ids, Request(max_new, params, seed))


def priced_drafts_equal_ar(target, staged, params, first_prompt: int) -> tuple[int, int]:
    """Chains and priced W = 4 trees of up to 13 rows (context statistics) on `staged` decode AR's tokens (greedy) or
    AR's keyed draws (sampled, seeded) on 4 prompts; returns (drafts kept, drafts verified)."""
    from spd.drafters.suffix import SuffixDrafter
    from spd.pricing import RowCosts
    from spd.runtime.chain import ChainDecoder

    kept = verified = 0
    for seed in range(4):
        p = prompt(seed + first_prompt, vocab=target.config.vocab_size)
        ar = ar_run(target, p, 40, params, seed=seed).token_ids
        for width in (1, 4):
            decoder = ChainDecoder(staged, SuffixDrafter(1, 4, RowCosts.flat(13)), frozenset(), 6, width=width,
                                   budget=12)
            out = decoder.generate(p, Request(40, params, seed))
            assert out.token_ids == ar, (seed, width)
            kept += out.stats.accepted
            verified += sum(counts[0] for counts in out.stats.sources.values())
    return kept, verified


class ScriptedDrafter(WrappedDrafter):
    """Runs a real drafter every step (its cost and state stay real) but drafts with the *target's own* logits
    for the sequence in flight, except at every `wrong_every`-th position, where it drafts with them reversed.
    Greedy or sampled, a run then holds long accepted stretches *and* rollbacks (with residual resampling)."""

    def __init__(self, inner: Drafter, model, wrong_every: int, on_step=None):
        super().__init__(inner)
        self.model, self.wrong_every, self.on_step = model, wrong_every, on_step
        self.steps = 0

    def start(self, prompt_hidden, prompt_ids):
        self.seq = dict(enumerate(prompt_ids))  # pos -> token, as the views show them (verified or in flight)
        self.inner.start(prompt_hidden, prompt_ids)

    @torch.no_grad()
    def propose(self, view, propose):
        self.steps += 1
        if self.on_step:
            self.on_step(self.steps)
        self.inner.propose(view, propose)
        for item in view.in_flight:
            self.seq[item.pos] = item.token
        tokens = [self.seq[pos] for pos in range(view.t + 1)]
        logits = self.model(torch.tensor([tokens])).logits[0, -1]
        return propose(-logits if (view.t + 1) % self.wrong_every == 0 else logits)


class RankedDrafter(WrappedDrafter):
    """Runs the real module every step but drafts from the target's own logits for the branch it is shown, with
    the target's token moved to rank ranks[pos % len(ranks)]: ranks < W keep it among a node's W children (a first,
    second, ... child is accepted), larger ranks leave it out (a correction)."""

    def __init__(self, inner, model, ranks):
        super().__init__(inner)
        self.model, self.ranks = model, ranks

    def start(self, prompt_hidden, prompt_ids):
        self.verified = list(prompt_ids)
        self.inner.start(prompt_hidden, prompt_ids)

    @torch.no_grad()
    def propose(self, view, propose):
        self.inner.propose(view, propose)
        oldest = view.in_flight[0]          # verified: every position is the oldest in flight before it leaves
        del self.verified[oldest.pos:]
        self.verified.append(oldest.token)
        seq = self.verified + [item.token for item in view.in_flight[1:]]
        logits = self.model(torch.tensor([seq])).logits[0, -1]
        order = torch.argsort(logits, descending=True).tolist()
        best = order.pop(0)
        order.insert(self.ranks[(view.t + 1) % len(self.ranks)], best)
        fake = torch.empty_like(logits)
        fake[torch.tensor(order)] = torch.linspace(10, -10, len(order))
        return propose(fake)


def read_wandb_offline(run_dir: str, wait_for=None, timeout: float = 30.0) -> dict:
    """Metrics logged to an offline W&B run, read back from its run-*.wandb file (a LevelDB-style record log
    of protobuf Records: 7-byte file header, 32 KiB blocks, each record with a 7-byte header). wandb-core
    writes the file in its own process and may still be flushing when `finish()` returns: wait for a key."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        found = _read_wandb_records(run_dir)
        if wait_for is None or wait_for in found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def _read_wandb_records(run_dir: str) -> dict:
    import glob
    import json
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(f"{run_dir}/run-*.wandb")
    with open(path, "rb") as f:
        raw = f.read()
    block, pos, pending, found = 32768, 7, b"", {}
    while pos + 7 <= len(raw):
        left = block - pos % block
        crc, length, kind = struct.unpack("<IHB", raw[pos: pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):
            pos += left  # block trailer or padding
            continue
        data, pos = raw[pos + 7: pos + 7 + length], pos + 7 + length
        pending = data if kind in (1, 2) else pending + data
        if kind not in (1, 4):  # FIRST / MIDDLE fragments: wait for the rest
            continue
        record = pb.Record()
        try:
            record.ParseFromString(pending)
        except Exception:  # a record still being written: read again later
            continue
        items = {"history": lambda r: r.history.item, "summary": lambda r: r.summary.update}
        kind_name = record.WhichOneof("record_type")
        if kind_name in items:
            for item in items[kind_name](record):
                found[(kind_name, item.key or "/".join(item.nested_key))] = json.loads(item.value_json)
    return found


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_train_main():
    spec = importlib.util.spec_from_file_location("train_run", os.path.join(ROOT, "train", "run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main




def snapshot(root) -> dict:
    files = {}
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files


def count_kept_children(monkeypatch, module) -> list:
    """Patches `module.settle_children` to record the index of the child each verification kept (None: a
    correction); returns the list it fills."""
    seen = []
    rule = module.settle_children

    def counted(*args):
        out = rule(*args)
        seen.append(out[0])
        return out

    monkeypatch.setattr(module, "settle_children", counted)
    return seen


def eval_replay_equals_runtime(main, capsys, target: str, tmp_path, *keys: str) -> None:
    """`spd-infer eval` of a pipelined method over the tiny target's traces (the exact replay) and step by step
    (exact_trace=true): every runtime sample = AR, the replay = the runtime (N, K, sources, each step's rows), and
    both summaries price their steps by the rows each stage ran."""
    import json

    runs = {}
    for mode, flag in (("fast", "exact_trace=false"), ("runtime", "exact_trace=true")):
        out = str(tmp_path / mode)
        assert main(["eval", f"target={target}", f"output_dir={out}", f"trace_cache_dir={tmp_path}/traces", "n=2",
                     *keys, "limit=1", "max_new_tokens=8", flag, "wandb.mode=disabled"]) == 0
        capsys.readouterr()
        with open(f"{out}/samples.jsonl") as f:
            runs[mode] = [json.loads(line) for line in f]
        assert [r["mode"] for r in runs[mode]] == [mode] * 3
        with open(f"{out}/summary.json") as f:
            speedup = json.load(f)["speedup"]
        assert speedup["calibration"]["rows_priced"] and speedup["measured_cost"]["overall"] > 0
    assert all(r["ar_match"] for r in runs["runtime"])
    for fast, runtime in zip(runs["fast"], runs["runtime"]):
        assert (fast["N"], fast["K"], fast["sources"], fast["step_rows"]) == \
            (runtime["N"], runtime["K"], runtime["sources"], runtime["step_rows"])
        assert sum(fast["step_rows"].values()) == fast["K"]
