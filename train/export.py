"""Write a trained EAGLE-3 head in the layout a serving engine loads (docs/training.md, "Sharing heads").

    python train/export.py outputs/eagle3/checkpoint --format sglang --out outputs/eagle3-sglang
    python train/export.py spd/assets/modules/smollm2-eagle3 --format speculators --out outputs/eagle3-speculators

--format sglang and vllm write the same HF layout (LlamaForCausalLMEagle3, the fused layers in both engines'
conventions); speculators writes vLLM's Eagle3Speculator. Any head this suite reads can be exported, an engine's
own included (pass --target for those: they do not name a loadable target).
"""

import argparse
import sys

KNOWN_VERIFIERS = {"SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}   # the default target's hub id


def main(argv=None) -> int:
    from spd.models.formats.eagle3 import FORMATS

    ap = argparse.ArgumentParser(prog="train/export.py", description="Write a trained EAGLE-3 head in a serving "
                                 "engine's layout.")
    ap.add_argument("checkpoint", help="a checkpoint directory of method=eagle3 (or a head in an engine's layout)")
    ap.add_argument("--format", required=True, choices=sorted(FORMATS), help="sglang and vllm: the HF layout; "
                    "speculators: vLLM's Eagle3Speculator")
    ap.add_argument("--out", required=True, help="the directory to write (replaced whole if it exists)")
    ap.add_argument("--target", default=None, help="the target to load (default: the one the checkpoint names)")
    ap.add_argument("--verifier", default=None, help="the target's name recorded for the engine (default: its hub "
                    "id where known, else --target)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="the tensors' dtype (default: the checkpoint's own, so the export drafts exactly as it does)")
    ap.add_argument("--speculative-tokens", type=int, default=3, help="speculators: drafts per step vLLM runs")
    args = ap.parse_args(argv)

    from spd.errors import UserError, run_command

    def body() -> int:
        from spd.models.checkpoint import FORMAT, checkpoint_method, load_checkpoint, read_checkpoint_config
        import torch

        from spd.models.formats.eagle3 import stored_dtype, write_head
        from spd.targets.loading import load_target
        from spd.targets.source import resolve_source
        from spd.targets.stages import StagedTarget

        cfg = read_checkpoint_config(args.checkpoint)
        method = checkpoint_method(args.checkpoint, cfg)
        if method != "eagle3":
            raise UserError(f"checkpoint {args.checkpoint!r} is a {method} module; the engines' layouts hold EAGLE-3 "
                            "heads (an SPD module stays in this suite's format)")
        if args.speculative_tokens < 1:
            raise UserError(f"--speculative-tokens {args.speculative_tokens}: give at least 1")
        target = args.target or (cfg["target"]["name"] if cfg["format"] == FORMAT else None)
        if target is None:
            raise UserError(f"{args.checkpoint!r} is an engine-format head, which names no loadable target; pass "
                            "--target")
        if args.target is None:
            try:
                resolve_source(target)
            except UserError:
                raise UserError(f"{args.checkpoint!r} was trained on target {target!r}, which does not load from "
                                "here by that name; pass --target <its directory or .gguf file>") from None
        loaded = load_target(target)
        module = load_checkpoint(args.checkpoint, StagedTarget(loaded.model, 1), loaded)
        module = module.to(getattr(torch, args.dtype) if args.dtype else stored_dtype(args.checkpoint))
        verifier = args.verifier or KNOWN_VERIFIERS.get(loaded.name, target)
        write_head(module, args.format, args.out, loaded.model.config,
                   loaded.model.get_input_embeddings().weight, verifier, args.speculative_tokens)
        print(f"exported {args.checkpoint} -> {args.out} ({args.format}; verifier {verifier})")
        return 0

    return run_command("train/export.py", body)


if __name__ == "__main__":
    sys.exit(main())
