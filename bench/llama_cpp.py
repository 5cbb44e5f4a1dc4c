"""llama.cpp (llama-cpp-python, the `peers` extra) decoding the same GGUF file as the suite, as bench.clock's peer
arms: its plain decoding and its own prompt-lookup speculation, on the prompt's token ids, at the suite's thread
count. Its kernels quantize activations to 8 bits and differ with the batch size, so its text need not equal the
suite's AR (or its own plain decoding); bench.clock reports how often it does."""

from __future__ import annotations

import os
import time

from spd.decoding import GenerationResult
from spd.errors import UserError
from spd.targets.source import resolve_source

KINDS = ("plain", "lookup")          # --llama: llama.cpp's plain decoding, its prompt-lookup speculation


def gguf_path(target: str) -> str:
    source = resolve_source(target)
    if not source.gguf_file:
        raise UserError(f"--llama decodes a GGUF file; target={target} is not one")
    return os.path.join(source.directory, source.gguf_file)


def llama_run(target: str, kind: str, threads: int, temperature: float, max_new_tokens: int, eos: set[int],
              seed_of, lookup_tokens: int = 10):
    """run(key, ids) -> GenerationResult: llama.cpp's greedy (or T = 1, top-k 50, seeded per prompt) decoding of
    up to max_new_tokens after `ids`, stopping at an end-of-sequence id; seconds from the call to the first and to
    the last token, as the suite's arms count them."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        raise UserError("--llama needs llama-cpp-python: pip install -e '.[peers]' (builds for this CPU)") from None
    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens) if kind == "lookup" else None
    model = Llama(model_path=gguf_path(target), n_ctx=4096, n_threads=threads, n_threads_batch=threads,
                  verbose=False, draft_model=draft)

    def run(key, ids):
        model.reset()
        sample = dict(temp=temperature, top_k=50, top_p=1.0, min_p=0.0) if temperature else dict(temp=0.0, top_k=1)
        if temperature:
            model.set_seed(seed_of(key))
        out, first = [], None
        start = time.perf_counter()
        for token in model.generate(ids, reset=True, repeat_penalty=1.0, **sample):
            first = time.perf_counter() - start if first is None else first
            out.append(int(token))
            if token in eos or len(out) >= max_new_tokens:
                break
        return GenerationResult(out, time.perf_counter() - start, first_seconds=first)
    return run
