"""A drafter from another package: its drafter file and its registry entry (with a key of its own) installed as an
`spd.methods` entry point, nothing in spd touched. The suite then decodes with it on every runtime that claims a
draft-then-verify method (the eager reference, the device step) and in a batch, and every greedy and sampled
answer is AR's own."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

DRAFTER = '''
"""A toy drafter: after each token, the token that followed it last in the verified text, chained."""
from spd.drafters.base import CHAIN, Cycle, Drafter
from spd.verify.sampling import Proposal
from spd.verify.tree import DraftTree


class BigramDrafter(Drafter):
    capabilities = frozenset({CHAIN})

    def __init__(self, longest: int):
        self.longest = longest

    def start(self, prompt_hidden, tokens):
        self.after, self.seen = {}, 0
        self.observe(prompt_hidden, tokens)

    def observe(self, hidden, tokens):
        for i in range(max(self.seen - 1, 0), len(tokens) - 1):
            self.after[tokens[i]] = tokens[i + 1]
        self.seen = len(tokens)

    def propose(self, cycle: Cycle, choose=None) -> DraftTree:
        drafts, token = [], cycle.root
        while len(drafts) < min(cycle.m, self.longest) and token in self.after:
            token = self.after[token]
            drafts.append(Proposal(token, source="bigram"))
        return DraftTree.chain(cycle.root, drafts)


def chain_drafter(*, bigram):
    return BigramDrafter(bigram.bigram_longest)
'''

REGISTRY = '''
from dataclasses import dataclass

from spd.errors import UserError
from spd.methods import CHAIN, Method


@dataclass
class BigramKeys:
    bigram_longest: int = 3              # method=bigram: the most tokens a cycle drafts

    def check(self):
        if self.bigram_longest < 1:
            raise UserError(f"bigram_longest={self.bigram_longest} must be >= 1")


METHOD = Method("bigram", "Bigram (toy)", CHAIN, None, draft_length=4, drafter="toy_drafters.bigram:chain_drafter",
                keys=BigramKeys, device_step=True)
'''

# what pip writes for a project whose pyproject.toml declares [project.entry-points."spd.methods"]
ENTRY_POINTS = '[spd.methods]\nbigram = toy_drafters.registry:METHOD\n'
METADATA = 'Metadata-Version: 2.1\nName: toy-drafters\nVersion: 0.1\n'

RUN = '''
import json, sys
from spd.config import GenerateConfig, load_config
from spd.decoding import Request
from spd.engine import open_engine
from spd.methods import METHODS
from spd.runtimes import RUNTIMES
from spd.verify.sampling import SamplingParams

target, prompts = sys.argv[1], [[5, 9, 3, 5, 9, 3, 7, 5, 9], [4, 4, 8, 1, 4, 4, 8]]
params = {"greedy": SamplingParams(0.0), "sampled": SamplingParams(1.0, top_k=20)}


def answers(*keys, batch=False):
    cfg = load_config(GenerateConfig, None, [f"target={target}", "max_new_tokens=24", *keys])
    with open_engine(cfg) as engine:
        out = {"decoder": type(engine.decoder).__name__, "accepted": 0}
        for name, p in params.items():
            requests = [Request(24, p, seed=7 + i) for i in range(len(prompts))]
            if batch:
                decoder = engine.batch_decoder(2)
                tickets = [decoder.submit(ids, r) for ids, r in zip(prompts, requests)]
                decoder.run()
                out[name] = [t.tokens for t in tickets]
                out["accepted"] += sum(t.stats.accepted for t in tickets if hasattr(t.stats, "accepted"))
                continue
            out[name] = []
            for ids, r in zip(prompts, requests):
                out[name].append(list(engine.decoder.generate(ids, r).token_ids))
                out["accepted"] += getattr(engine.decoder.stats, "accepted", 0)
        return out


method = METHODS["bigram"]
claimed = [r.name for r in RUNTIMES.values() if not r.cuda and (r.chains or (r.device_step and method.device_step))]
result = {"claimed": claimed, "ar": answers("method=ar"), "runs": {}}
for name in claimed:
    result["runs"][name] = answers("method=bigram", f"runtime={name}", "bigram_longest=2")
result["runs"]["local, batched"] = answers("method=bigram", "runtime=local", batch=True)
print(json.dumps(result))
'''


def install(root) -> None:
    """The toy package and its install record (dist-info with the entry point) under `root`."""
    package = root / "toy_drafters"
    package.mkdir()
    (package / "bigram.py").write_text(textwrap.dedent(DRAFTER))
    (package / "registry.py").write_text(textwrap.dedent(REGISTRY))
    info = root / "toy_drafters-0.1.dist-info"
    info.mkdir()
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    (info / "METADATA").write_text(METADATA)


def run(root, *args, code=RUN) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600)


def test_an_installed_drafter_runs_on_every_runtime_that_claims_it(tmp_path, tiny_target_dir):
    install(tmp_path)
    done = run(tmp_path, tiny_target_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["claimed"] == ["local", "device"]
    assert result["runs"]["device"]["decoder"] == "DeviceChainDecoder"
    assert result["runs"]["local"]["decoder"] == "ChainDecoder"
    for name, answers in result["runs"].items():
        for kind in ("greedy", "sampled"):       # greedy: AR's argmax; sampled: AR's keyed draws, token for token
            assert answers[kind] == result["ar"][kind], (name, kind)
        assert answers["accepted"] > 0, name        # its drafts were verified and kept: it really drafted
    assert result["ar"]["greedy"] != result["ar"]["sampled"]


def test_an_installed_methods_keys_and_refusals_are_the_suites(tmp_path, tiny_target_dir):
    """Its key is a config key like any other (checked by its own rule, refused in one line, exit 2), --help lists
    the method, and a runtime that runs no chain refuses it in one line."""
    install(tmp_path)
    cli = "import sys; from spd.cli import main; sys.exit(main(sys.argv[1:]))"
    helped = run(tmp_path, "generate", "--help", code=cli)
    assert helped.returncode == 0 and "bigram" in helped.stdout
    bad = run(tmp_path, "generate", f"target={tiny_target_dir}", "method=bigram", "bigram_longest=0", "prompt=hi",
              code=cli)
    assert bad.returncode == 2 and "bigram_longest=0 must be >= 1" in bad.stderr and "Traceback" not in bad.stderr
    remote = run(tmp_path, "generate", f"target={tiny_target_dir}", "method=bigram", "runtime=distributed",
                 "prompt=hi", code=cli)
    assert remote.returncode == 2 and "method=bigram drafts and verifies in one process" in remote.stderr
    assert len(remote.stderr.strip().splitlines()) == 1
