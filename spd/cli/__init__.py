"""`spd-infer`: thin command-line entry over the library. Bad input -> one line on stderr, exit code 2.

Nothing heavy is imported until the command line and the config are checked, so bad input is refused at once;
the commands import torch and transformers when they start decoding.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import warnings

from spd.errors import UserError, run_command

DECODE_COMMANDS = ("generate", "chat")  # their words are read by spd.cli.args, not argparse
STATS_HELP = textwrap.fill(
    "The stats line (stderr, after the text): [what decoded, its settings] N = tokens generated; a chain's cycles = "
    "target forwards and τ = N / cycles (tokens a forward); a pipeline's K = pipeline steps, α = accepted / verified "
    "drafts, L′acc = n·N/K (its equivalent acceptance length) and rollbacks = rejected drafts; 'accepted: datastore "
    "0.42 (8/19)' = per draft source, the share of its verified drafts kept (kept/verified); tokens/s counts from the "
    "prompt's arrival; seed= repeats a sampled run. docs/evaluation.md defines each measure.", 118)
PROMPT_HELP = ("the prompt, verbatim: a positional argument, prompt=TEXT (never parsed as YAML), prompt_file=PATH, "
               "'-' or a pipe for standard input, or any text after --")


def build_parser() -> argparse.ArgumentParser:
    from spd.cli.keys import KeysParser
    from spd.config import GenerateConfig, ServeConfig
    from spd.eval.config import EvalConfig
    from spd.methods import DECODING_METHODS

    # every command's --help ends with its keys, defaults and meanings, generated from the structured configs
    parser = KeysParser(prog="spd-infer", description="Speculative Pipeline Decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in [("generate", "decode one prompt (the fastest lossless method here, or method= one of "
                                    f"{', '.join(DECODING_METHODS)}), streaming the text"),
                       ("chat", "a multi-turn conversation on standard input (/exit leaves, /reset starts over)")]:
        cmd = sub.add_parser(name, help=text, description=text, schema=GenerateConfig, epilog=STATS_HELP)
        cmd.add_argument("--config", default=None, help="YAML config (configs/infer/generate.yaml)")
        cmd.add_argument("words", nargs="*", metavar="key=value | PROMPT",
                         help="config overrides (e.g. n=5 max_new_tokens=64); " +
                         (PROMPT_HELP if name == "generate" else "the turns come from standard input"))
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions) "
                                      "over one warm pipeline", description="generate's keys, plus host=, port=, "
                                      "api_key=, max_queue=, shutdown_timeout_s=", schema=ServeConfig)
    sv.add_argument("--config", default=None, help="YAML config (configs/infer/serve.yaml)")
    sv.add_argument("overrides", nargs="*", help="key=value overrides, e.g. port=8000 method=spd n=2")
    ev = sub.add_parser("eval", help="MT-Bench / GSM8K / HumanEval: L′acc, speedups, JSONL, table, plots, W&B",
                        description=textwrap.fill(
                            "MT-Bench / GSM8K / HumanEval: L′acc, speedups, JSONL, table, plots, W&B. Results go to "
                            "output_dir= (default outputs/eval/run, under the current directory); the target's greedy "
                            "traces are cached beside its weights, under $SPD_CACHE_DIR (default ~/.cache/spd)/traces "
                            "(trace_cache_dir=)", 118), schema=EvalConfig)
    ev.add_argument("--config", default=None, help="YAML config (configs/eval/*.yaml)")
    ev.add_argument("overrides", nargs="*", help="key=value overrides, e.g. checkpoint=DIR limit=20 n=5")
    rep = sub.add_parser("report", help="rebuild the table and plots from one or more eval directories")
    rep.add_argument("dirs", nargs="+", help="eval output directories (each holds summary.json)")
    rep.add_argument("--out", default=None, help="where to write table.md and the PNGs (default: the first dir)")
    return parser


def quiet_libraries() -> None:
    """stderr holds results or one error line: no FutureWarnings, no progress bars from transformers."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def decode_command(command: str, words: list[str], parser: argparse.ArgumentParser) -> int:
    """generate / chat: the words are read by spd.cli.args (argparse would take a prompt like `-x` for an option)."""
    from spd.cli.args import prompt_text, read_prompts_file, resolve_prompt, split_command_line
    from spd.config import GenerateConfig, load_config
    from spd.fastest import apply_fastest_default
    from spd.paths import check_checkpoint_dir
    from spd.targets.source import resolve_source

    line = split_command_line(words, GenerateConfig, command)
    if line.help:
        parser.parse_args([command, "--help"])
    if command == "chat" and line.prompt_sources():
        raise UserError("chat reads its turns from standard input; drop the prompt argument")
    cfg = load_config(GenerateConfig, line.config, line.overrides, prompt_text(line, command))
    if command == "chat" and (cfg.prompt is not None or cfg.prompt_file is not None):
        raise UserError("chat reads its turns from standard input; drop prompt/prompt_file from the config")
    if cfg.prompts_file is not None and (command == "chat" or cfg.prompt is not None or cfg.prompt_file is not None):
        raise UserError("prompts_file= decodes many prompts with generate; give it alone, without prompt/prompt_file"
                        if command == "generate" else "chat reads its turns from standard input; drop prompts_file")
    many = read_prompts_file(cfg.prompts_file) if cfg.prompts_file is not None else None
    prompt = resolve_prompt(cfg) if command == "generate" and many is None else None
    resolve_source(cfg.target)  # a bad target= is refused before torch is imported
    check_checkpoint_dir(cfg.checkpoint, cfg.method)  # and so is a checkpoint= directory that is not there
    default = apply_fastest_default(cfg, GenerateConfig, line.overrides)
    quiet_libraries()
    if command == "chat":
        from spd.cli.chat import chat

        return chat(cfg, default=default)
    from spd.cli.generate import generate, generate_many

    return generate_many(cfg, many, default=default) if many is not None else generate(cfg, prompt, default=default)


def serve_command(args) -> int:
    from spd.config import ServeConfig, load_config
    from spd.fastest import apply_fastest_default
    from spd.paths import check_checkpoint_dir
    from spd.targets.source import resolve_source

    cfg = load_config(ServeConfig, args.config, args.overrides)
    resolve_source(cfg.target)
    check_checkpoint_dir(cfg.checkpoint, cfg.method)
    default = apply_fastest_default(cfg, ServeConfig, args.overrides)
    quiet_libraries()
    from spd.cli.serve import serve

    return serve(cfg, default=default)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # e.g. weight-loading bars: stderr holds results or one error
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()

    def body() -> int:
        if argv and argv[0] in DECODE_COMMANDS:
            return decode_command(argv[0], argv[1:], parser)
        args = parser.parse_args(argv)
        from spd.cli.evaluate import cmd_eval, cmd_report

        if args.command == "serve":
            return serve_command(args)
        return {"eval": cmd_eval, "report": cmd_report}[args.command](args)   # each quiets the libraries itself

    return run_command("spd-infer", body)


def entry() -> None:
    """The console script. After generate/chat, skip the interpreter's teardown of torch and transformers (over a
    second on these machines, longer than a short answer): stages are closed and the output is flushed by then."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv and argv[0] in (*DECODE_COMMANDS, "serve"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
