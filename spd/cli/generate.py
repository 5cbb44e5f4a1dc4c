"""`spd-infer generate`: one prompt, decoded with the method asked for (SPD, PPSD, SPD's output-state ablation,
EAGLE-3's chain, the lookup chain, plain AR) or, when no key chooses, spd.fastest's; text streams out as tokens are
verified."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import torch
from transformers import TextStreamer

from spd.ar import ar_generate
from spd.methods import AR, METHODS
from spd.runtime.chain import ChainDecoder
from spd.runtime.pipeline import PipelineDecoder, pipeline_ar_generate
from spd.runtime.stages import open_stages
from spd.session import Session, encode_prompt, open_session


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


class Decoding:
    """What one configured command decodes with: the session, its open stages and drafter, reused across prompts
    (chat turns) so stage processes start once."""

    def __init__(self, cfg, session: Session, stages, drafter, default: bool = False):
        self.cfg, self.session, self.stages, self.drafter = cfg, session, stages, drafter
        self.default = default   # no key chose the method: spd.fastest's for this device

    def run(self, prompt_ids: list[int], on_token=None) -> dict:
        cfg, s = self.cfg, self.session
        generator = torch.Generator(device=s.staged.device).manual_seed(cfg.seed)
        method = METHODS[s.method]
        if method.decoder == AR and cfg.runtime == "local" and not cfg.cuda_graphs:
            result = ar_generate(s.staged, prompt_ids, cfg.max_new_tokens, s.params, s.eos_ids, generator, on_token)
        elif method.decoder == AR:  # AR relayed through the same stage processes / fixed-shape steps
            result = pipeline_ar_generate(self.stages, prompt_ids, cfg.max_new_tokens, s.params, s.eos_ids,
                                          generator, on_token)
        elif method.chain:
            decoder = ChainDecoder(s.staged, self.drafter, s.params, s.eos_ids, s.draft_length)
            result = decoder.generate(prompt_ids, cfg.max_new_tokens, generator, on_token)
        else:
            decoder = PipelineDecoder(self.stages, self.drafter, s.params, s.eos_ids)
            result = decoder.generate(prompt_ids, cfg.max_new_tokens, generator, on_token)
        stats = result.stats.as_dict() if result.stats else {"N": len(result.token_ids), "K": None, "alpha": None,
                                                              "eal": None, "rollbacks": None}
        return {"text": s.loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True),
                "token_ids": result.token_ids, "prompt_token_ids": prompt_ids, "method": s.method,
                "draft_source": s.draft_source if method.pipelined else None, "runtime": cfg.runtime,
                "processes": getattr(self.stages, "world", 1), "n": s.staged.n, "stage_bounds": s.staged.bounds,
                "balance": s.balance,
                "checkpoint": s.checkpoint, **stats, "seconds": result.seconds, "tokens_per_s": result.tokens_per_s,
                "default": self.default}


@contextmanager
def open_decoding(cfg, default: bool = False):
    """The session and its stages (stage processes for runtime=distributed), closed on exit.
    default: the method is spd.fastest's (the stats line says so)."""
    session = open_session(cfg)
    report_balance(session)
    drafter = session.drafter(cfg.module_cache) if METHODS[session.method].decoder != AR else None
    capture = drafter.layers_needed(session.staged.bounds) if drafter else []
    with open_stages(session.staged, cfg, capture, session.cache_dir) as stages:
        yield Decoding(cfg, session, stages, drafter, default)


def report_balance(session: Session) -> None:
    if session.balance:
        b = session.balance
        print(f"[spd] stage_bounds=balanced -> {b['stage_bounds']}: stage times "
              f"{', '.join(f'{t * 1e3:.2f}' for t in b['stage_s'])} ms (even split: "
              f"{', '.join(f'{t * 1e3:.2f}' for t in b['even_stage_s'])} ms), predicted step "
              f"{b['predicted_step_s'] * 1e3:.2f} ms at {b['threads']} thread(s)", file=sys.stderr)


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def acceptance_by_source(sources: dict) -> str:
    """ "lookup 0.85 (41/48), module 0.27 (9/33)": per draft source, accepted / verified drafts."""
    return ", ".join(f"{source} {accepted / verified:.2f} ({accepted}/{verified})"
                     for source, (verified, accepted) in sorted(sources.items()))


def stats_line(out: dict) -> str:
    speed = f"tokens/s={out['tokens_per_s']:.1f}"
    chosen = ", the default here" if out.get("default") else ""
    if "tau" in out:   # draft-then-verify: tokens per target forward, not pipeline steps
        return (f"[{out['method']} m={out['m']}{chosen}] N={out['N']} cycles={out['cycles']} τ={_fmt(out['tau'])} "
                f"accepted: {acceptance_by_source(out.get('sources', {})) or '-'} {speed}")
    runtime = out["runtime"] + (f" ({out['processes']} processes)" if out.get("processes", 1) > 1 else "")
    if out["K"] is None:   # plain AR: in one process it has no stages; relayed through stage processes it has n
        where = "local" if out["runtime"] == "local" else f"n={out['n']} {runtime}"
        return f"[ar {where}{chosen}] N={out['N']} {speed}"
    return (f"[{out['method']} n={out['n']} {runtime}, {out['draft_source']}{chosen}] N={out['N']} K={out['K']} "
            f"α={_fmt(out['alpha'])} L′acc={_fmt(out['eal'])} rollbacks={out['rollbacks']} "
            f"accepted: {acceptance_by_source(out['sources']) or '-'} {speed}")


def generate(cfg, prompt: str, default: bool = False) -> int:
    with open_decoding(cfg, default) as decoding:
        prompt_ids = encode_prompt(decoding.session, prompt, cfg.chat_template, cfg.max_new_tokens)
        if cfg.json:
            print(json.dumps(decoding.run(prompt_ids)))
            return 0
        stream = TextStream(decoding.session.loaded.tokenizer, sys.stdout)
        out = decoding.run(prompt_ids, on_token=stream)
        stream.end()
    print(stats_line(out), file=sys.stderr)
    return 0
