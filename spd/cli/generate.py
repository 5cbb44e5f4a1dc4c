"""`spd-infer generate`: one prompt, decoded with the method asked for (SPD, PPSD, SPD's output-state ablation,
EAGLE-3's chain, the lookup chain, plain AR) or, when no key chooses, spd.fastest's; text streams out as tokens are
verified."""

from __future__ import annotations

import json
import sys

import torch
from transformers import TextStreamer

from spd.engine import open_engine
from spd.session import encode_prompt


class TextStream(TextStreamer):
    """Prints verified tokens as text as soon as they form whole words (transformers' streamer, our stream)."""

    def __init__(self, tokenizer, stream):
        super().__init__(tokenizer, skip_prompt=False, skip_special_tokens=True)
        self.stream = stream

    def __call__(self, token_id: int) -> None:
        self.put(torch.tensor([token_id]))

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.stream.write(text + ("\n" if stream_end else ""))
        self.stream.flush()


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def acceptance_by_source(sources: dict) -> str:
    """ "lookup 0.85 (41/48), module 0.27 (9/33)": per draft source, accepted / verified drafts."""
    return ", ".join(f"{source} {accepted / verified:.2f} ({accepted}/{verified})"
                     for source, (verified, accepted) in sorted(sources.items()))


def with_seed(engine, out: dict) -> dict:
    """The record with the seed a sampled run drew with (seed=null picks a fresh one per run: this repeats it), or
    None where it decoded greedily (no seed is used)."""
    return {**out, "seed": None if engine.session.params.greedy else engine.session.spec.sampling.seed}


def stats_line(out: dict) -> str:
    speed = f"tokens/s={out['tokens_per_s']:.1f}" + (f" seed={out['seed']}" if out.get("seed") is not None else "")
    chosen = ", the default here" if out.get("default") else ""
    # what the products read, where it is not the float32 weights (weights=q4: the GGUF's own blocks)
    chosen = (f" weights={out['weights']}" if out.get("weights", "float32") != "float32" else "") + chosen
    if "tau" in out:   # draft-then-verify: tokens per target forward, not pipeline steps
        tree = f" W={out['W']} tree_nodes={out['tree_nodes']}" if out.get("W", 1) > 1 else ""
        tree += f" datastore={out['datastore']}" if out.get("datastore") else ""
        tree += f" dtype={out['dtype']}" if out.get("dtype", "float32") != "float32" else ""
        return (f"[{out['method']} m={out['m']}{tree}{chosen}] N={out['N']} cycles={out['cycles']} τ={_fmt(out['tau'])} "
                f"accepted: {acceptance_by_source(out.get('sources', {})) or '-'} {speed}")
    runtime = out["runtime"] + (f" ({out['processes']} processes)" if out.get("processes", 1) > 1 else "")
    if out["K"] is None:   # plain AR: in one process it has no stages; relayed through stage processes it has n
        where = "local" if out["runtime"] == "local" else f"n={out['n']} {runtime}"
        return f"[ar {where}{chosen}] N={out['N']} {speed}"
    tree = f" W={out['W']}" if out.get("W", 1) > 1 else ""
    tree += f" segment={out['segment']}" if out.get("segment") else ""
    source = out["draft_source"] or f"draft model of {out.get('draft_layers')} layer(s)"
    return (f"[{out['method']} n={out['n']} {runtime}, {source}{tree}{chosen}] N={out['N']} K={out['K']} "
            f"α={_fmt(out['alpha'])} L′acc={_fmt(out['eal'])} rollbacks={out['rollbacks']} "
            f"accepted: {acceptance_by_source(out['sources']) or '-'} {speed}")


def generate(cfg, prompt: str, default: bool = False) -> int:
    with open_engine(cfg, default) as engine:
        prompt_ids = encode_prompt(engine.session, prompt, cfg.chat_template, cfg.max_new_tokens)
        if cfg.json:
            print(json.dumps(with_seed(engine, engine.run(prompt_ids))))
            return 0
        stream = TextStream(engine.session.loaded.tokenizer, sys.stdout)
        out = with_seed(engine, engine.run(prompt_ids, on_token=stream))
        stream.end()
    print(stats_line(out), file=sys.stderr)
    return 0


def generate_many(cfg, prompts: list[str], default: bool = False) -> int:
    """prompts_file=: every prompt decoded, up to max_batch per forward where the method allows (AR, the chains),
    else one after another; one JSON record per prompt on standard output, in the file's order, each as soon as it
    and those before it are done. The records' seconds are each decode's own (admission to last token)."""
    from tqdm import tqdm

    from spd.decoding import GenerationResult

    with open_engine(cfg, default) as engine:
        ids = [encode_prompt(engine.session, p, cfg.chat_template, cfg.max_new_tokens) for p in prompts]
        batch = engine.batch_decoder(cfg.max_batch) if cfg.max_batch > 1 else None
        bar = tqdm(total=len(ids), desc="generate", unit="prompt", disable=None, file=sys.stderr)
        if batch is None:
            for prompt_ids in ids:
                print(json.dumps(with_seed(engine, engine.run(prompt_ids))), flush=True)
                bar.update()
            bar.close()
            return 0
        tickets = [batch.submit(prompt_ids, engine.request()) for prompt_ids in ids]
        printed = 0
        while printed < len(tickets):
            batch.step()
            while printed < len(tickets) and tickets[printed].done:
                t = tickets[printed]
                record = engine.record(t.prompt_ids, GenerationResult(t.tokens, t.seconds, t.stats))
                print(json.dumps({**with_seed(engine, record), "max_batch": cfg.max_batch}), flush=True)
                printed += 1
            bar.n = sum(t.done for t in tickets)
            bar.refresh()
        bar.close()
    return 0
