"""`spd-infer`: thin command-line entry over the library. Bad input -> one line on stderr, exit code 2."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from spd.errors import UserError


def _generate(cfg) -> dict:
    import torch

    from spd.ar import ar_generate
    from spd.runtime.pipeline import PipelineDecoder, pipeline_ar_generate
    from spd.runtime.stages import open_stages
    from spd.session import encode_prompt, open_session

    if cfg.method not in ("spd", "ar"):
        raise UserError(f"method={cfg.method!r} is not one of: spd, ar")
    session = open_session(cfg)
    if session.balance:
        b = session.balance
        print(f"[spd] stage_bounds=balanced -> {b['stage_bounds']}: stage times "
              f"{', '.join(f'{t * 1e3:.2f}' for t in b['stage_s'])} ms (even split: "
              f"{', '.join(f'{t * 1e3:.2f}' for t in b['even_stage_s'])} ms), predicted step "
              f"{b['predicted_step_s'] * 1e3:.2f} ms at {b['threads']} thread(s)", file=sys.stderr)
    prompt_ids = encode_prompt(session, cfg.prompt, cfg.chat_template, cfg.max_new_tokens)
    generator = torch.Generator(device=session.staged.device).manual_seed(cfg.seed)
    drafter = session.drafter(cfg.module_cache)
    capture = drafter.layers_needed(session.staged.bounds) if cfg.method == "spd" else []
    with open_stages(session.staged, cfg, capture, session.cache_dir) as stages:
        if cfg.method == "ar" and cfg.runtime == "local":
            result = ar_generate(session.staged, prompt_ids, cfg.max_new_tokens, session.params, session.eos_ids,
                                 generator)
        elif cfg.method == "ar":  # plain pipeline-parallel AR over the same stage processes
            result = pipeline_ar_generate(stages, prompt_ids, cfg.max_new_tokens, session.params, session.eos_ids,
                                          generator)
        else:
            decoder = PipelineDecoder(stages, drafter, session.params, session.eos_ids)
            result = decoder.generate(prompt_ids, cfg.max_new_tokens, generator)
    stats = result.stats.as_dict() if result.stats else {"N": len(result.token_ids), "K": None, "alpha": None,
                                                          "eal": None, "rollbacks": None}
    return {"text": session.loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True),
            "token_ids": result.token_ids, "method": cfg.method, "runtime": cfg.runtime, "n": session.staged.n,
            "stage_bounds": session.staged.bounds, "balance": session.balance, **stats,
            "seconds": result.seconds, "tokens_per_s": result.tokens_per_s}


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def cmd_generate(args) -> int:
    from spd.config import GenerateConfig, load_config

    cfg = load_config(GenerateConfig, args.config, args.overrides)
    out = _generate(cfg)
    if cfg.json:
        print(json.dumps(out))
    else:
        print(out["text"])
        print(f"[{out['method']} n={out['n']}] N={out['N']} K={_fmt(out['K'], 'd')} α={_fmt(out['alpha'])} "
              f"L′acc={_fmt(out['eal'])} rollbacks={_fmt(out['rollbacks'], 'd')} "
              f"tokens/s={out['tokens_per_s']:.1f}", file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    from spd.eval.config import EvalConfig
    from spd.config import load_config
    from spd.eval.harness import run_eval

    cfg = load_config(EvalConfig, args.config, args.overrides)
    summary = run_eval(cfg, log=lambda msg: print(f"[eval] {msg}", file=sys.stderr))
    overall = summary["overall"]
    print(f"[eval] {summary['run']['label']} T={cfg.temperature:g}: L′acc (pooled) {overall['eal_pooled']:.3f}, "
          f"mean of per-sample ratios {overall['eal_mean_of_ratios']:.3f}, {overall['samples']} samples -> "
          f"{cfg.output_dir}", file=sys.stderr)
    return 0


def cmd_report(args) -> int:
    from spd.eval.report import load_run, report_command

    for path in report_command(args.dirs, args.out):
        print(path)
    for directory in args.dirs:
        run = load_run(directory)
        print(f"{directory}: {run['run']['label']} L′acc {run['overall']['eal_pooled']:.3f}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spd-infer", description="Speculative Pipeline Decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="decode one prompt with SPD (or method=ar)")
    gen.add_argument("--config", default=None, help="YAML config (configs/infer/generate.yaml)")
    gen.add_argument("overrides", nargs="*", help="key=value overrides, e.g. n=5 max_new_tokens=64")
    gen.set_defaults(func=cmd_generate)
    ev = sub.add_parser("eval", help="MT-Bench / GSM8K / HumanEval: L′acc, speedups, JSONL, table, plots, W&B")
    ev.add_argument("--config", default=None, help="YAML config (configs/eval/*.yaml)")
    ev.add_argument("overrides", nargs="*", help="key=value overrides, e.g. checkpoint=DIR limit=20 n=5")
    ev.set_defaults(func=cmd_eval)
    rep = sub.add_parser("report", help="rebuild the table and plots from one or more eval directories")
    rep.add_argument("dirs", nargs="+", help="eval output directories (each holds summary.json)")
    rep.add_argument("--out", default=None, help="where to write table.md and the PNGs (default: the first dir)")
    rep.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # e.g. GGUF de-quantisation bars: stderr holds results or one error
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr stays clean: results, or exactly one error line
    parser = build_parser()
    args = parser.parse_args(argv)
    from spd.runtime.distributed.comm import PipelineFailure

    try:
        return args.func(args)
    except UserError as exc:
        print(f"spd-infer: error: {exc}", file=sys.stderr)
        return 2
    except PipelineFailure as exc:
        print(f"spd-infer: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("spd-infer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
