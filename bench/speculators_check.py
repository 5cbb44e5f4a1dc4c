"""A real consumer of the exported heads: vLLM's `speculators` library loads what train/export.py writes, and its
model's draft logits are compared with this suite's module for the same inputs.

    python -m bench.speculators_check --out docs/results/speculators_check.json

speculators 0.9.0 pins transformers <= 5.19 (the suite runs 5.25), so it runs in a venv of its own, built once under
outputs/venvs/speculators (torch 2.13.0 as here, transformers 5.19.0, speculators without torchvision/torchaudio,
which its EAGLE-3 model never imports). For each head — a random one on the tiny Llama target and the shipped
SmolLM2 head — the check exports it with `--format speculators`, runs the target over a prompt, and hands the fused
states and the next tokens to speculators' own forward (bench/speculators_side.py, three training-time-test steps);
step j is compared at the rows whose inputs are real tokens in both (the rest pad differently).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, "outputs", "venvs", "speculators")
PINS = ["torch==2.13.0", "transformers==5.19.0", "aiohttp", "click", "datasets>=4.0.0,<=5.1.0", "httpx",
        "huggingface-hub", "loguru>=0.7.2,<=0.7.3", "numpy>=2.0.0,<=2.5.4", "openai>=2.0.0", "protobuf", "psutil",
        "pydantic>=2", "pydantic-settings>=2", "rich", "safetensors", "tqdm>=4.66.3,<=4.70.1", "typer>=0.12.0"]
NO_DEPS = ["speculators==0.9.0", "hs-connectors==0.9.0"]   # without their torchvision/torchaudio pins
STEPS = 3
PROMPT = "Explain in two sentences why the sky is blue, then give one everyday example of the same effect."


def venv_python(venv: str) -> str:
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, *PINS], check=True)
        subprocess.run([*pip, "--no-deps", *NO_DEPS], check=True)
    return python


def cases():
    """(name, loaded target, module) for each head checked."""
    from spd.models.checkpoint import load_checkpoint
    from spd.models.eagle3 import Eagle3Module
    from spd.models.shipped import checkpoint_for
    from spd.targets.loading import load_target
    from spd.targets.stages import StagedTarget

    tiny = load_target("tiny-llama")
    draft = torch.arange(0, tiny.model.config.vocab_size, 3)
    yield "tiny-llama, random head", tiny, Eagle3Module.from_target(StagedTarget(tiny.model, 1), draft, seed=7)
    shipped = checkpoint_for(None, "smollm2", None, None, "eagle3")
    if shipped:
        smollm2 = load_target("smollm2")
        yield f"SmolLM2-135M, shipped head ({os.path.basename(shipped)})", smollm2, \
            load_checkpoint(shipped, StagedTarget(smollm2.model, 1), smollm2)


def check(python: str, name: str, loaded, module, work: str) -> dict:
    from spd.models.formats.eagle3 import write_head
    from spd.targets.stages import StagedTarget

    module = module.float().eval()
    model = loaded.model
    verifier = os.path.join(work, "verifier")      # speculators reads the verifier's config (no hub here)
    model.save_pretrained(verifier)    # its config and weights (speculators reads both)
    head = os.path.join(work, "head")
    write_head(module, "speculators", head, model.config, model.get_input_embeddings().weight, verifier)
    if loaded.tokenizer is not None and loaded.tokenizer.vocab_size > 1000:
        ids = loaded.tokenizer(PROMPT, return_tensors="pt").input_ids[:, :48]
    else:
        ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    staged = StagedTarget(model, 1)
    with torch.no_grad():
        _, hidden = staged.forward_all(ids, None, capture=frozenset(module.layers_needed()))
        ours = module.forward_ttt(hidden, steps=STEPS)           # step j, row i predicts x_{i+2+j}
    rows = ids.shape[1] - 1                                       # row i reads (x_{i+1}, f_i)
    aux = torch.cat([hidden[k] for k in module.fused], -1)[:, :rows]
    save_file({"aux": aux.contiguous(), "input_ids": ids[:, 1:].contiguous()}, os.path.join(work, "in.safetensors"))
    run = subprocess.run([python, os.path.join(ROOT, "bench", "speculators_side.py"), head,
                          os.path.join(work, "in.safetensors"), os.path.join(work, "out.safetensors"), str(STEPS)],
                         capture_output=True, text=True)
    if run.returncode:
        return {"case": name, "ok": False, "error": run.stderr.strip().splitlines()[-1]}
    meta = json.loads(run.stdout.strip().splitlines()[-1])
    theirs = load_file(os.path.join(work, "out.safetensors"))
    steps = []
    for j in range(STEPS):
        valid = rows - j                                          # rows whose step-j inputs are real tokens in both
        a, b = ours[j][0, :valid], theirs[f"logits_{j}"][0, :valid]
        steps.append({"step": j, "rows": valid, "max_abs_diff": float((a - b).abs().max()),
                      "max_abs_logit": float(a.abs().max()),
                      "argmax_equal": int((a.argmax(-1) == b.argmax(-1)).sum()),
                      "drafts_equal": int((theirs[f"drafts_{j}"][0, :valid] == a.argmax(-1)).sum())})
    ok = all(s["argmax_equal"] == s["rows"] == s["drafts_equal"] and s["max_abs_diff"] <= 1e-3 * max(1.0, s["max_abs_logit"])
             for s in steps) and not meta["missing_keys"] and not meta["unexpected_keys"]
    return {"case": name, "ok": ok, "draft_vocab": int(module.head.weight.shape[0]), "fused_layers": list(module.fused),
            "prompt_tokens": int(ids.shape[1]), "speculators_side": meta, "steps": steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench.speculators_check")
    ap.add_argument("--out", default="docs/results/speculators_check.json")
    ap.add_argument("--venv", default=VENV)
    args = ap.parse_args(argv)
    start = time.time()
    python = venv_python(args.venv)
    results = []
    for name, loaded, module in cases():
        with tempfile.TemporaryDirectory() as work:
            results.append(check(python, name, loaded, module, work))
            print(json.dumps(results[-1]))
    import transformers

    report = {"command": "python -m bench.speculators_check --out " + args.out, "ok": all(r["ok"] for r in results),
              "suite": {"torch": torch.__version__, "transformers": transformers.__version__},
              "seconds": round(time.time() - start, 1), "cases": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"{'all equal' if report['ok'] else 'MISMATCH'}: {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
