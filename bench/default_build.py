"""The default on a CPU as the clock builds it — `method=suffix W=4 datastore=...`, 16 drafted nodes, depth
15, priced with this machine's row costs — for the benches that look inside it (cycle_parts, noise_calibration)."""

from __future__ import annotations

import types

from spd.decoding import eos_ids_of
from spd.drafters.suffix import Retrieval, SuffixDrafter
from spd.engine import build_decoder
from spd.methods import CHAIN
from spd.corpora.retrieval import open_datastore
from spd.targets.row_costs import cached_row_costs
from bench.prompt_sets import prompt_set


def first_prompts(name: str, count: int, tokenizer) -> list[tuple[str, list[int]]]:
    """The first `count` prompts of a set in its order (eval: MT-Bench's first, then GSM8K's, then HumanEval's — so up
    to 80, MT-Bench questions only)."""
    limits = types.SimpleNamespace(limit=count, everyday_limit=count)
    return prompt_set(name, limits, tokenizer)[:count]


def default_decoder(loaded, staged, datastore: str, drafter_class=SuffixDrafter, **drafter_options):
    """(the drafter, the decoder): a drafter_class (SuffixDrafter or a subclass that watches it) over `datastore`,
    with any other SuffixDrafter options."""
    store = Retrieval(open_datastore(datastore, loaded.tokenizer, loaded.model.config.vocab_size))
    drafter = drafter_class(1, 8, cached_row_costs(staged, 17), retrieval=store, **drafter_options)
    decoder = build_decoder(CHAIN, staged, eos_ids_of(loaded.model.config, loaded.tokenizer), drafter,
                            draft_length=15, width=4, tree_nodes=16)
    return drafter, decoder
