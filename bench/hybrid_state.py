"""What keeping a hybrid's linear-attention states costs, beside the layer's own work: one Qwen3.5 Gated DeltaNet
layer at the 4B's dimensions (random weights, this CPU, float32 and bfloat16), per decoded token:

- the layer's one-token forward through the suite's row path (`spd.targets.gated_delta`, which also writes the
  token's conv window and recurrent state into the ring),
- that snapshot alone (the ring write of one position),
- a rollback (the ring's length moved back; the next row reads the kept slot in place),
- transformers' own one-token forward over its DynamicCache (the layer as a plain decode runs it), for scale,

and the bytes: a layer's state per kept position against one attention layer's K/V per token, and the whole
target's ring at the default rollback.

The 4B's shape is its published config.json (hidden 2560, 32 layers, every fourth full attention with 16 query /
4 key-value heads of 256; linear layers with 16 key heads and 32 value heads of 128, conv kernel 4): the model hub
is not reachable here, so those numbers are written below rather than read.

    python -m bench.hybrid_state --out docs/results/hybrid_state.json
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from spd.eval.output import write_json
from spd.targets.gated_delta import rowwise, step_rows
from spd.targets.linear_states import ROLLBACK, LinearStates
from spd.targets.row_costs import _cpu_name
from spd.targets.timing import median_seconds

SHAPE_4B = dict(hidden_size=2560, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, intermediate_size=9216, vocab_size=248320)


def measure(dtype: torch.dtype, repeats: int) -> dict:
    config = Qwen3_5TextConfig(**SHAPE_4B)
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(config, 0).to(dtype).eval().requires_grad_(False)
    stock = Qwen3_5GatedDeltaNet(config, 0).to(dtype).eval().requires_grad_(False)
    stock.load_state_dict(layer.state_dict())
    rowwise(layer)
    lengths = [0]
    states = LinearStates(lengths)
    context = torch.randn(1, 64, config.hidden_size, dtype=dtype)
    with torch.no_grad():
        step_rows(layer, context, states, None)                     # 64 tokens of context in the ring
        token = torch.randn(1, 1, config.hidden_size, dtype=dtype)
        forward = median_seconds(lambda: step_rows(layer, token, states, None), repeats, cpu,
                                 reset=lambda: states.set_length(0, 64))
        window, state = states.after(0, 63)
        window, state = window.clone(), state.clone()
        snapshot = median_seconds(lambda: states.add(0, [63], [window], [state]), repeats, cpu,
                                  reset=lambda: states.set_length(0, 64))

        def rollback():
            states.set_length(0, 64)
            return states.after(0, 63)

        def advance():
            for _ in range(4):
                states.add(0, [lengths[0] - 1], [window], [state])
        restore = median_seconds(rollback, repeats, cpu, reset=advance)
        cache = DynamicCache(config=Qwen3_5TextConfig(**{**SHAPE_4B, "num_hidden_layers": 1,
                                                          "layer_types": ["linear_attention"]}))
        stock(context, cache=cache)
        plain = median_seconds(lambda: stock(token, cache=cache), repeats, cpu)
    return {"forward_one_token_s": forward, "snapshot_s": snapshot, "rollback_s": restore,
            "transformers_one_token_s": plain,
            "snapshot_over_forward": snapshot / forward, "rollback_over_forward": restore / forward}


def sizes() -> dict:
    s = SHAPE_4B
    conv = (2 * s["linear_num_key_heads"] * s["linear_key_head_dim"] + s["linear_num_value_heads"]
            * s["linear_value_head_dim"]) * s["linear_conv_kernel_dim"]
    recurrent = s["linear_num_value_heads"] * s["linear_key_head_dim"] * s["linear_value_head_dim"]
    kv_token = 2 * s["num_key_value_heads"] * s["head_dim"]
    linear_layers = s["num_hidden_layers"] * 3 // 4
    per_position = recurrent * 4 + conv * 2                  # the recurrent state in float32, the window in bf16
    return {"conv_window_values": conv, "recurrent_state_values": recurrent,
            "bytes_per_kept_position_per_layer": per_position,
            "kv_values_per_token_per_attention_layer": kv_token, "kv_bytes_per_token_per_attention_layer": kv_token * 2,
            "kept_position_in_tokens_of_kv": per_position / (kv_token * 2),
            "linear_layers": linear_layers, "rollback": ROLLBACK,
            "ring_bytes_whole_target": per_position * (ROLLBACK + 1) * linear_layers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results/hybrid_state.json")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    result = {"command": f"python -m bench.hybrid_state --out {args.out}", "cpu": _cpu_name(),
              "threads": torch.get_num_threads(), "shape": "Qwen3.5-4B linear-attention layer", "sizes": sizes(),
              "float32": measure(torch.float32, args.repeats), "bfloat16": measure(torch.bfloat16, args.repeats)}
    write_json(args.out, result)
    for dtype in ("float32", "bfloat16"):
        r = result[dtype]
        print(f"{dtype}: forward {r['forward_one_token_s'] * 1e3:.2f} ms, snapshot {r['snapshot_s'] * 1e3:.3f} ms "
              f"({r['snapshot_over_forward']:.1%}), rollback {r['rollback_s'] * 1e3:.3f} ms, transformers "
              f"{r['transformers_one_token_s'] * 1e3:.2f} ms")
    print(result["sizes"])


if __name__ == "__main__":
    main()
