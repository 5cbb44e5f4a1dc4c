"""The target's own answers as a datastore (`datastore=answers`): the default target's greedy answers to
ShareGPT first turns that no benchmark set holds (spd.corpora.retrieval.answer_prompts: the everyday set's conversations and
any that quote an eval prompt are held out), decoded many at a time (spd.runtime.batch, plain AR, float32), kept in
chunks under --cache-dir as they finish (an interrupted or time-limited run resumes at the first missing chunk; on a
machine without the chunks, those the packed file already holds are taken from it), and
packed into spd/assets/datastore/answers-<tokenizer key>.safetensors (ids and lengths only; the suffix array is built
when a run opens it).

ShareGPT's own assistant turns are another model's phrasing; the target's answers to similar requests are its own,
which is what the drafts must match.

    python -m bench.target_answers --count 8192 --minutes 60      # about 9,000 tokens a minute on 2 cores
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tqdm import tqdm

from spd.corpora.datastore import load_documents, save_documents, tokenizer_key
from spd.decoding import Request, eos_ids_of
from spd.engine import build_batch_decoder
from spd.methods import AR
from spd.corpora.prompts import chat_prompt_ids
from spd.corpora.retrieval import ANSWERS, answer_prompts, answers_path
from spd.targets.loading import load_target
from spd.targets.stages import StagedTarget


def chunk_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"chunk{index:05d}.pt")


def chunk_prompts(prompts: list[tuple[str, str]], index: int, size: int) -> list[str]:
    return [text for _, text in prompts[index * size: (index + 1) * size]]


def saved_chunks(directory: str, prompts: list[tuple[str, str]], size: int) -> dict[int, list[list[int]]]:
    """The answers of the chunks on disk, from the first up to the first missing one or one that answers other prompts
    than this list puts there."""
    saved = {}
    while os.path.isfile(chunk_path(directory, len(saved))):
        index = len(saved)
        chunk = torch.load(chunk_path(directory, index))
        if chunk["prompts"] != chunk_prompts(prompts, index, size):
            break
        saved[index] = chunk["tokens"]
    return saved


def seed_chunks(directory: str, prompts: list[tuple[str, str]], size: int, path: str, target: str,
                max_new_tokens: int) -> int:
    """Write the chunks a packed file already holds (this target's answers, of this length, to the same prompts in
    the same order) where the cache has none, so a fresh machine resumes where the package left off instead of
    decoding its answers again; returns the chunks written."""
    if not os.path.isfile(path) or os.path.isfile(chunk_path(directory, 0)):
        return 0
    documents, meta = load_documents(path)
    ids = meta.get("record_ids", [])
    if (meta.get("target") != target or meta.get("max_new_tokens") != max_new_tokens
            or ids != [record_id for record_id, _ in prompts[: len(ids)]] or len(ids) != len(documents)):
        return 0
    written = 0
    while written * size < len(documents):
        tokens = [doc.tolist() for doc in documents[written * size: (written + 1) * size]]
        texts = chunk_prompts(prompts, written, size)
        if len(tokens) < len(texts):          # a part of a chunk: its other answers are decoded with it
            break
        torch.save({"prompts": texts, "tokens": tokens}, chunk_path(directory, written))
        written += 1
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=8192, help="answers in the corpus (the first of the fixed order)")
    ap.add_argument("--minutes", type=float, default=None, help="stop decoding after this long; pack what is done")
    ap.add_argument("--batch", type=int, default=32, help="sequences per forward")
    ap.add_argument("--chunk", type=int, default=128, help="answers a file under --cache-dir")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--cache-dir", default="outputs/cache/answers")
    ap.add_argument("--out", default=None, help="default: the package's answers file for this tokenizer")
    args = ap.parse_args()
    loaded = load_target()
    tokenizer, key = loaded.tokenizer, tokenizer_key(loaded.tokenizer)
    directory = os.path.join(args.cache_dir, f"{loaded.fingerprint[:16]}-greedy-{args.max_new_tokens}")
    os.makedirs(directory, exist_ok=True)
    prompts = answer_prompts(log=lambda message: None)[: args.count]
    chunks = -(-len(prompts) // args.chunk)
    out = args.out or answers_path(key)
    seeded = seed_chunks(directory, prompts, args.chunk, out, loaded.fingerprint, args.max_new_tokens)
    if seeded:
        print(f"{seeded} chunks of answers taken from {out}")
    saved = saved_chunks(directory, prompts, args.chunk)
    done = len(saved)
    decoder = build_batch_decoder(AR, StagedTarget(loaded.model, 1), eos_ids_of(loaded.model.config, tokenizer),
                                  max_batch=args.batch)
    request = Request(args.max_new_tokens)
    pending = {index: [decoder.submit(chat_prompt_ids(tokenizer, text), request)
                       for text in chunk_prompts(prompts, index, args.chunk)]
               for index in range(done, chunks)}
    deadline = time.time() + 60 * args.minutes if args.minutes is not None else None
    bar = tqdm(total=len(prompts), initial=done * args.chunk, desc="answers", unit="answer")
    while pending and (deadline is None or time.time() < deadline):
        decoder.step()
        for index in [i for i, tickets in pending.items() if all(t.done for t in tickets)]:
            tickets = pending.pop(index)
            path = chunk_path(directory, index)
            saved[index] = [t.tokens for t in tickets]
            torch.save({"prompts": chunk_prompts(prompts, index, args.chunk), "tokens": saved[index]}, path + ".tmp")
            os.replace(path + ".tmp", path)
            bar.update(len(tickets))
    bar.close()
    done = next(index for index in range(len(saved) + 1) if index not in saved)   # the first chunk still missing
    documents = [tokens for index in range(done) for tokens in saved[index]]
    meta = {"source": ANSWERS, "tokenizer": key, "target": loaded.fingerprint, "decoding": "greedy, float32",
            "max_new_tokens": args.max_new_tokens, "answers": len(documents),
            "tokens": sum(map(len, documents)), "record_ids": [rid for rid, _ in prompts[: len(documents)]],
            "packed_by": " ".join(["python", *sys.argv])}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    save_documents(out, documents, meta)
    print(f"{len(documents)} answers, {meta['tokens']} tokens -> {out}"
          + (f" ({len(pending)} chunks left: run again to go on)" if pending else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
