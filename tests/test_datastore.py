"""Drafting from a datastore (spd.corpora.datastore, datastore=): the suffix array finds what a scan of the corpus finds, the
file round-trips and a wrong one is refused, a user's .txt / .jsonl text is built once per content and tokenizer (and
refused in one line when it holds none), its candidates are their own source for the pricing, and greedy decoding with
them is the target's own while they are drafted and kept (sampling: tests/test_lossless_sampling_chains.py)."""

import os
import random

import pytest
from hypothesis import given, settings, strategies as st

from helpers import GREEDY, ar_run, prompt
from spd.corpora.datastore import Datastore, Stores, load_documents, save_documents
from spd.decoding import Request
from spd.drafters.suffix import DATASTORE, Retrieval, SuffixDrafter
from spd.errors import UserError
from spd.pricing import AcceptancePredictor, Evidence
from spd.runtime.chain import ChainDecoder
from spd.targets.stages import StagedTarget
from spd.targets.tiny import FAMILIES, tiny_model
from test_suffix import CPU_LIKE


def scan(documents, context, max_n, length):
    """By brute force: the longest suffix of context (<= max_n) found inside one document, and every continuation."""
    best, found = 0, []
    for n in range(1, min(max_n, len(context)) + 1):
        gram = context[len(context) - n:]
        hits = [doc[i + n: i + n + length] for doc in documents for i in range(len(doc) - n + 1) if doc[i: i + n] == gram]
        if not hits:
            break
        best, found = n, hits
    return best, sorted(h for h in found if h)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=30), min_size=1, max_size=6),
       st.lists(st.integers(0, 5), min_size=1, max_size=12), st.integers(1, 6))
def test_the_suffix_array_finds_what_a_scan_finds(documents, context, max_n):
    store = Datastore.build(documents, 6)
    n, following = store.continuations(context, max_n, 1, limit=10_000, length=4)
    want_n, want = scan(documents, context, max_n, 4)
    assert n == want_n
    assert sorted(following) == want


def test_a_frequent_match_is_sampled_evenly_and_stops_at_a_document_end():
    documents = [[1, 2, 3, i % 7 + 10] for i in range(500)] + [[9, 1, 2]]
    store = Datastore.build(documents, 20)
    n, following = store.continuations([5, 1, 2], 8, 1, limit=16, length=3)
    assert n == 2 and len(following) == 16                       # "1 2" occurs 501 times: 16 of them, spread
    assert all(path[0] == 3 and len(path) == 2 for path in following)    # the separator ends each continuation
    assert len({path[1] for path in following}) == 7             # spread evenly: every one of the 7 endings
    assert store.continuations([4, 4], 8, 1, 16, 3) == (0, [])  # a token the corpus never holds
    assert store.continuations([7, 2], 8, 2, 16, 3) == (0, [])  # a one-token match, where two are asked


def test_the_file_round_trips_and_a_wrong_one_is_refused(tmp_path):
    from spd.corpora.retrieval import open_datastore

    class Tokenizer:                   # what open_datastore reads of a tokenizer
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

        def __len__(self):
            return len(self.vocab)

    from spd.corpora.datastore import tokenizer_key

    ours, theirs = Tokenizer({"a": 0, "b": 1, "c": 2}), Tokenizer({"a": 0, "c": 1, "b": 2})
    store = Datastore.build([[0, 1, 2, 0, 1]], 3, {"tokenizer": tokenizer_key(ours)})
    path = str(tmp_path / "store.safetensors")
    store.save(path)
    assert os.listdir(tmp_path) == ["store.safetensors"]           # nothing half-written beside it
    again = open_datastore(path, ours, 3)
    assert again.continuations([1, 2], 8, 1, 8, 4) == store.continuations([1, 2], 8, 1, 8, 4) == (2, [[0, 1]])
    with pytest.raises(UserError, match="another tokenizer"):
        open_datastore(path, theirs, 3)
    with pytest.raises(UserError, match="neither 'sharegpt', 'answers', a datastore file nor"):
        open_datastore(str(tmp_path / "missing.safetensors"), ours, 3)
    (tmp_path / "junk.safetensors").write_text("not a datastore")
    with pytest.raises(UserError, match="not a datastore file"):
        open_datastore(str(tmp_path / "junk.safetensors"), ours, 3)
    # a documents file (what bench/target_answers.py packs) opens as the datastore of its documents
    save_documents(str(tmp_path / "docs.safetensors"), [[0, 1, 2, 0, 1]], {"tokenizer": tokenizer_key(ours)})
    assert open_datastore(str(tmp_path / "docs.safetensors"), ours, 3).continuations([1, 2], 8, 1, 8, 4) == (2, [[0, 1]])
    with pytest.raises(UserError, match="another tokenizer"):
        open_datastore(str(tmp_path / "docs.safetensors"), theirs, 3)


class CharTokenizer:
    """A tokenizer of the letters a..e (what open_datastore reads of one: its vocabulary, its length, and a call)."""

    def get_vocab(self):
        return {c: i for i, c in enumerate("abcde")}

    def __len__(self):
        return 5

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [["abcde".index(c) for c in text if c in "abcde"] for text in texts]}


def test_a_text_file_is_a_datastore_built_once_per_content(tmp_path, monkeypatch):
    """datastore=<file>.jsonl / .txt: the user's documents, tokenised for the target and cached by the file's bytes
    and the tokenizer; the same file is read from the cache, a changed one built again; bad files are refused."""
    from spd.corpora.retrieval import open_datastore

    monkeypatch.setenv("SPD_CACHE_DIR", str(tmp_path / "cache"))
    said: list[str] = []
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "abcab"}\n\n{"text": "cabd", "id": 7}\n')
    store = open_datastore(str(corpus), CharTokenizer(), 5, log=said.append)
    # "ab" is followed by "cab" (then the first document ends) and by "d" (the second's); "ca" by "b" and "bd"
    n, following = store.continuations([0, 1], 8, 1, 8, 4)
    assert n == 2 and sorted(following) == [[2, 0, 1], [3]]
    n, following = store.continuations([2, 0], 8, 1, 8, 4)
    assert n == 2 and sorted(following) == [[1], [1, 3]]
    assert len(said) == 1 and "building" in said[0]
    cached = os.listdir(tmp_path / "cache" / "datastore")
    assert len(cached) == 1 and cached[0].endswith(".safetensors")        # nothing half-written beside it
    again = open_datastore(str(corpus), CharTokenizer(), 5, log=said.append)
    assert len(said) == 1 and sorted(again.continuations([0, 1], 8, 1, 8, 4)[1]) == [[2, 0, 1], [3]]
    corpus.write_text('{"text": "abe"}\n')
    assert open_datastore(str(corpus), CharTokenizer(), 5, log=said.append).continuations([0, 1], 8, 1, 8, 4) == \
        (2, [[4]])
    text = tmp_path / "notes.txt"
    text.write_text("abd\n\nabd")                       # a .txt file is one document (the newlines: no tokens here)
    n, following = open_datastore(f"{text}+{corpus}", CharTokenizer(), 5, log=said.append).continuations(
        [0, 1], 8, 1, 8, 4)
    assert n == 2 and sorted(following[:2]) == [[3], [3, 0, 1, 3]] and following[2:] == [[4]]   # the .txt's first
    for body, needle in [("", "holds no text"), ('{"text": "ab"}\n{"text": 3}\n', "line 2 is not a JSON object"),
                         ("not json\n", "line 1 is not a JSON object"), ('{"text": " "}\n', "holds no text")]:
        corpus.write_text(body)
        with pytest.raises(UserError, match=needle):
            open_datastore(str(corpus), CharTokenizer(), 5, log=said.append)
    text.write_bytes(b"\xff\xfe abd")
    with pytest.raises(UserError, match="not UTF-8"):
        open_datastore(str(text), CharTokenizer(), 5, log=said.append)
    assert len(os.listdir(tmp_path / "cache" / "datastore")) == 3          # what was refused left nothing


def test_several_stores_speak_in_turn_up_to_the_limit():
    first = Datastore.build([[1, 2, 3, 4]], 10)
    second = Datastore.build([[0, 1, 2, 5, 6], [1, 2, 7], [9, 0, 1, 2, 8]], 10)
    n, following = Stores([first, second]).continuations([0, 1, 2], 8, 1, limit=3, length=2)
    assert n == 3                                     # the second's match is the longer: its length is reported
    assert following[0] == [3, 4]                      # the first's occurrence comes first
    assert sorted(following[1:]) == [[5, 6], [8]]     # then the second's, of its own longest match
    # a first store that fills the limit leaves the second nothing; one that finds nothing leaves it everything
    assert Stores([second, first]).continuations([0, 1, 2], 8, 1, 2, 2) == second.continuations([0, 1, 2], 8, 1, 2, 2)
    assert Stores([first, second]).continuations([9, 0], 8, 2, 4, 2) == second.continuations([9, 0], 8, 2, 4, 2)
    assert len(Stores([first, second])) == len(first) + len(second)


@pytest.mark.parametrize("top", [9, 70_000])
def test_the_documents_file_round_trips(tmp_path, top):
    documents = [[1, 2, top], [], [top, 0]]
    path = str(tmp_path / "docs.safetensors")
    save_documents(path, documents, {"source": "answers", "tokenizer": "k"})
    assert os.listdir(tmp_path) == ["docs.safetensors"]
    got, meta = load_documents(path)
    assert [doc.tolist() for doc in got] == documents and meta == {"source": "answers", "tokenizer": "k"}
    Datastore.build([[0, 1]], 3).save(str(tmp_path / "store.safetensors"))
    with pytest.raises(ValueError, match="not a documents file"):
        load_documents(str(tmp_path / "store.safetensors"))


def test_the_shipped_answers_are_found_by_tokenizer_and_joined_with_plus(tmp_path, monkeypatch):
    import spd.corpora.retrieval as retrieval
    from spd.corpora.datastore import tokenizer_key

    class Tokenizer:
        def get_vocab(self):
            return {"a": 0, "b": 1, "c": 2}

        def __len__(self):
            return 3

    monkeypatch.setattr(retrieval, "ANSWERS_DIR", str(tmp_path / "assets"))
    tokenizer = Tokenizer()
    with pytest.raises(UserError, match="no answers of a target with this tokenizer"):
        retrieval.open_datastore("answers", tokenizer, 3)
    os.makedirs(tmp_path / "assets")
    save_documents(retrieval.answers_path(tokenizer_key(tokenizer)), [[0, 1, 2]], {"source": "answers"})
    store = Datastore.build([[0, 1, 0]], 3, {"tokenizer": tokenizer_key(tokenizer)})
    store.save(str(tmp_path / "other.safetensors"))
    assert retrieval.open_datastore("answers", tokenizer, 3).continuations([0, 1], 8, 1, 8, 4) == (2, [[2]])
    both = retrieval.open_datastore(f"answers+{tmp_path / 'other.safetensors'}", tokenizer, 3)
    assert both.continuations([0, 1], 8, 1, 8, 4) == (2, [[2], [0]])
    for spec in ("answers+answers", "answers+", "+answers"):
        with pytest.raises(UserError, match="join distinct datastores"):
            retrieval.open_datastore(spec, tokenizer, 3)


def test_a_corpus_that_is_seldom_right_does_not_talk_the_context_down():
    predictor = AcceptancePredictor()
    context = Evidence("suffix", 4, 1.0, 3, 1, margin=2.0)
    before = predictor.predict(context)
    corpus = Evidence(DATASTORE, 4, 1.0, 3, 1, margin=2.0)
    for _ in range(40):
        predictor.observe(corpus, False)
    assert predictor.predict(corpus) < 0.1
    assert predictor.predict(context) == pytest.approx(before)      # the calibration is per source


def test_candidates_from_the_context_come_first_and_the_corpus_adds_what_it_lacks():
    store = Datastore.build([[1, 2, 7, 8], [1, 2, 3, 6]], 10)
    drafter = SuffixDrafter(1, 4, retrieval=Retrieval(store, min_n=2))
    drafter.start(None, [5, 1, 2, 3, 9, 1, 2])
    nodes, evidence = drafter.candidates(m=2, width=4, budget=8)
    sources = [(nodes[i].token, nodes[i].parent, evidence[i].source) for i in range(len(nodes))]
    assert sources[:2] == [(3, -1, "suffix"), (9, 0, "suffix")]
    # the corpus's "1 2" went on with 7 8 and 3 6; 3 is the context's already, so its subtree is left out
    assert sources[2:] == [(7, -1, DATASTORE), (8, 2, DATASTORE)]
    assert [e.match for e in evidence[2:]] == [2, 2] and evidence[2].share == pytest.approx(0.5)


def answers(model, prompts, length):
    return [ar_run(model, p, length).token_ids for p in prompts]


@pytest.mark.parametrize("width,costs,split", [(1, None, False), (4, CPU_LIKE, False), (4, CPU_LIKE, True)])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_a_datastore_decodes_what_ar_decodes(family, width, costs, split):
    """The corpus holds the AR answers of half the prompts (drafted and kept there) and random text (drafted and
    missed): every output is AR's — also read from two stores in turn (split). Untied models: their answers depend
    on the whole context (a tied tiny model repeats one token, which the context's own statistics already draft)."""
    model = tiny_model(family, tied=False)
    vocab = model.config.vocab_size
    prompts = [prompt(seed + 300, vocab=vocab) for seed in range(4)]
    want = answers(model, prompts, 40)
    noise = [[random.Random(i).randrange(vocab) for _ in range(200)] for i in range(5)]
    store = Stores([Datastore.build([prompts[0] + want[0], *noise[:2]], vocab),
                    Datastore.build([prompts[2] + want[2], *noise[2:]], vocab)]) if split else \
        Datastore.build([prompts[0] + want[0], prompts[2] + want[2], *noise], vocab)
    drafter = SuffixDrafter(1, 4, costs, retrieval=Retrieval(store, min_n=1))
    decoder = ChainDecoder(StagedTarget(model, 1), drafter, frozenset(), 8, width, 12 if width > 1 else None)
    kept = missed = 0
    for p, ids in zip(prompts, want):
        out = decoder.generate(p, Request(40, GREEDY))
        assert out.token_ids == ids, family
        verified, accepted = out.stats.sources.get(DATASTORE, (0, 0))
        kept, missed = kept + accepted, missed + verified - accepted
    assert kept >= 10 and missed >= 1


def test_the_replay_settles_what_the_runtime_settles_with_a_datastore():
    from spd.eval.fast import record_greedy_trace
    from spd.eval.fast_chain import fast_tree_stats

    model = tiny_model("llama", tied=False)
    vocab = model.config.vocab_size
    staged = StagedTarget(model, 1)
    prompts = [prompt(seed + 320, vocab=vocab) for seed in range(3)]
    store = Datastore.build([p + a for p, a in zip(prompts[:2], answers(model, prompts[:2], 40))], vocab)
    drafted = 0
    for p in prompts:
        make = lambda: SuffixDrafter(1, 4, CPU_LIKE, retrieval=Retrieval(store, min_n=1))   # noqa: E731
        out = ChainDecoder(staged, make(), frozenset(), 8, 3, 12).generate(p, Request(40, GREEDY))
        got = fast_tree_stats(make(), record_greedy_trace(staged, p, 40, frozenset()), 8, 3, 12)
        want = out.stats
        assert (got["stats"].N, got["stats"].cycles, got["stats"].verdicts) == (want.N, want.cycles, want.verdicts)
        assert sum(got["rows_per_cycle"]) == want.drafted + want.cycles
        drafted += want.sources.get(DATASTORE, (0, 0))[0]
    assert drafted > 0


def test_generate_drafts_from_a_text_file_and_prints_ar_s_tokens(capsys, tiny_target_dir, tmp_path, monkeypatch):
    """`spd-infer generate ... datastore=corpus.jsonl` on a tiny target: the file is built into a datastore once and
    read from the cache after, and the tokens are AR's, greedy and keyed at T = 1. (Which candidates a datastore
    adds, and that they are kept, is the API tests' business above: the tiny target's answer repeats one token.)"""
    import json

    from test_cli import run

    monkeypatch.setenv("SPD_CACHE_DIR", str(tmp_path / "cache"))
    common = [f"target={tiny_target_dir}", "prompt=Tell me a story about 12 cats.", "max_new_tokens=40", "json=true"]
    ar = json.loads(run(capsys, *common, "method=ar")[1])
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "Once upon a time."}) + "\n" + json.dumps({"text": ar["text"]}) + "\n")
    code, out, err = run(capsys, *common, "method=suffix", "W=4", f"datastore={corpus}")
    assert code == 0, err
    got = json.loads(out)
    assert got["token_ids"] == ar["token_ids"] and "building the datastore" in err
    code, out, err = run(capsys, *common, "method=suffix", f"datastore={corpus}", "temperature=1", "seed=5")
    assert code == 0 and "building" not in err
    assert json.loads(out)["token_ids"] == json.loads(run(capsys, *common, "method=ar", "temperature=1",
                                                          "seed=5")[1])["token_ids"]
