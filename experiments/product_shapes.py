"""What a target forward of r rows costs on this CPU, and whether another way of multiplying its weights changes the
step at 4 rows: the forward with `F.linear` against every product on oneDNN's prepacked
weight (one copy: the plain weights are dropped), each shape timed right after a one-row forward as a decode loop
meets it; and the target's products alone — as they are, with q/k/v and gate/up fused into one product each, and
with the rows multiplied in chunks of at most 3 (the last row count before the step); and the products and the
forward from the suite's float32 panels (spd.targets.panel). `--layouts` adds the forward
with every weight stored column-major (one copy, so `F.linear` multiplies x by a contiguous W^T: MKL's other
operand order) and the forward in bfloat16, plain and prepacked (spd.targets.prepacked).

    python -m experiments.product_shapes --out docs/results/product_shapes_intel.json
    python -m experiments.product_shapes --layouts --out docs/results/product_layouts_intel.json

The figure's page: docs/speed-cpu.md, "The forward's row costs"; docs/speed-cpu.md, "What was tried and did not pay".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from spd.eval.output import write_json
from spd.targets.loading import load_target
from spd.targets import panel
from spd.targets.stages import StagedTarget


def forward_costs(staged: StagedTarget, rows: list[int], rounds: int, context: int = 256) -> dict[int, float]:
    """Median ms of a forward of each row count (embedding, every layer, the head) after `context` cached tokens,
    each right after a one-row forward."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(staged.config.vocab_size, (1, context + max(rows)), generator=generator)
    cache = staged.new_cache(context + max(rows))
    staged.forward_all(ids[:, :context], cache, 0)

    def forward(r: int) -> float:
        start = time.perf_counter()
        out, _ = staged.forward_all(ids[:, context: context + r], cache, context)
        staged.logits(out[0])
        seconds = time.perf_counter() - start
        cache.crop(context)
        return seconds

    times: dict[int, list[float]] = {r: [] for r in rows}
    for round_ in range(rounds + 1):
        for r in rows:
            forward(1)
            seconds = forward(r)
            if round_:                  # the first round warms every shape up
                times[r].append(seconds)
    return {r: 1e3 * statistics.median(t) for r, t in times.items()}


def prepack(model) -> None:
    """Every Linear multiplies with oneDNN's prepacked copy of its weight; the plain copy is dropped (a tied head
    keeps it: the embedding reads it)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear):
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach().contiguous())

            def forward(x, packed=packed, bias=module.bias):
                out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
                return out.reshape(*x.shape[:-1], out.shape[-1])

            module.forward = forward
            if name != "lm_head":
                module.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


def column_major(model) -> None:
    """Every Linear's weight becomes the transpose of a contiguous W^T, in place of the row-major copy (a tied head
    and embedding share it: an embedding row is then read strided)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = module.weight.data.T.contiguous().T


def weights(model, fused: bool) -> list[torch.Tensor]:
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if fused:
            out += [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight,
                    torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight]
        else:
            out += [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight, m.gate_proj.weight,
                    m.up_proj.weight, m.down_proj.weight]
    return [w.detach().contiguous() for w in out + [model.lm_head.weight]]


def product_costs(ws: list[torch.Tensor], rows: list[int], rounds: int, chunk: int = 0,
                  product=None) -> dict[int, float]:
    """Median ms of every product of the target over r rows [r, d_in] (in chunks of `chunk` rows when given; with
    `product(x, i)` instead of `F.linear(x, ws[i])` when given)."""
    out = {}
    for r in rows:
        x = {w.shape[1]: torch.randn(r, w.shape[1]) for w in ws}
        times = []
        for round_ in range(rounds + 1):
            start = time.perf_counter()
            for i, w in enumerate(ws):
                if product is not None:
                    product(x[w.shape[1]], i)
                elif chunk and r > chunk:
                    torch.cat([F.linear(x[w.shape[1]][i: i + chunk], w) for i in range(0, r, chunk)])
                else:
                    F.linear(x[w.shape[1]], w)
            if round_:
                times.append(time.perf_counter() - start)
        out[r] = 1e3 * statistics.median(times)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--rows", default="1,2,3,4,6,8,12,16,17,24,32")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layouts", action="store_true", help="column-major float32 and bfloat16 forwards as well")
    ap.add_argument("--out", default="docs/results/product_shapes.json")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    report = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__, "threads": args.threads}
    with torch.no_grad():
        model = load_target(args.target).model
        staged = StagedTarget(model, 1, plain_products=True)
        report["forward_ms"] = forward_costs(staged, rows, args.rounds)
        plain, fused = weights(model, False), weights(model, True)
        report["products_ms"] = product_costs(plain, rows, args.rounds)
        if panel.extension() is not None:       # the suite's float32 CPU products (spd.targets.panel)
            panels = [(w.shape[0], panel.pack(w)) for w in plain]
            report["products_panels_ms"] = product_costs(plain, rows, args.rounds, product=lambda x, i: panel.product(
                x, panels[i][1], panels[i][0], None))
            del panels
            panel.use_panels(model)
            report["forward_panels_ms"] = forward_costs(staged, rows, args.rounds)
            for module in model.modules():       # the Linears plain again for the rows below
                if type(module) is panel.PanelLinear:
                    module.__class__ = torch.nn.Linear
        report["products_fused_ms"] = product_costs(fused, rows, args.rounds)
        report["products_chunks_of_3_ms"] = product_costs(plain, [r for r in rows if r > 3], args.rounds, chunk=3)
        del plain, fused
        prepack(model)
        report["forward_prepacked_ms"] = forward_costs(staged, rows, args.rounds)
        del model, staged
        if args.layouts:
            for key, dtype, change in [("forward_column_major_ms", torch.float32, column_major),
                                       ("forward_bfloat16_ms", torch.bfloat16, None),
                                       ("forward_bfloat16_prepacked_ms", torch.bfloat16, prepack)]:
                model = load_target(args.target, dtype=dtype).model
                # bfloat16 on a CPU: row-invariant attention (as the suite runs it); float32: F.linear
                staged = StagedTarget(model, 1, plain_products=True)
                if change:
                    change(model)
                report[key] = forward_costs(staged, rows, args.rounds)
                del model, staged
    for key in [k for k in report if k.endswith("_ms")]:
        print(f"{key:32s}", " ".join(f"{r}:{ms:.1f}" for r, ms in report[key].items()))
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
