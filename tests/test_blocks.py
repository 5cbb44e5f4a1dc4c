"""A GGUF target's products from its own 4- and 8-bit blocks (spd.targets.blocks, `weights=q4`): at every ISA level
this CPU runs, a product from blocks gives a row the same bits at every row count, and is the product its arithmetic
defines up to float32 rounding (per block the weights' codes times the inputs' 16-bit codes, exact integers, then the
scales and minimum) — the dequantized weight's product up to the inputs' codes; VNNI or not, the same bits; the file's halves are read exactly, subnormal and -0 included; the self-check refuses a blocks kernel that
breaks the rule; drafted decoding over blocks is the target's own decoding; weights=q4 where there are no blocks to
read is refused in one line before anything loads."""

import pytest
import torch

from helpers import GREEDY, priced_drafts_equal_ar
from spd.decoding import SamplingParams
from spd.targets import blocks, panel
from spd.targets.stages import StagedTarget
from spd.targets.tiny import tiny_model

pytestmark = pytest.mark.skipif(panel.extension() is None, reason="the panel kernel cannot be built here")
LEVELS = panel.levels() if panel.extension() is not None else ()


def q4_blocks(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A float weight [N, K] as Q4_1 blocks the way a GGUF stores them: per 32 weights an fp16 scale and minimum and
    4-bit steps (in spd.targets.blocks' word layout)."""
    n, k = weight.shape
    w = weight.reshape(n, k // 32, 32)
    low, high = w.amin(-1), w.amax(-1)
    d = ((high - low) / 15).clamp_min(1e-4).half().float()
    m = low.half().float()
    q = ((w - m[..., None]) / d[..., None]).round().clamp(0, 15).to(torch.int64)      # [N, B, 32]
    words = (q.view(n, k // 32, 4, 8) << (4 * torch.arange(8))).sum(-1).to(torch.int32)
    return {"d": d, "m": m, "q": words}


def q8_blocks(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    n, k = weight.shape
    w = weight.reshape(n, k // 32, 32)
    d = (w.abs().amax(-1) / 127).clamp_min(1e-4).half().float()
    return {"d": d, "q8": (w / d[..., None]).round().clamp(-127, 127).to(torch.int8)}


def input_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [M, K] as the kernel quantizes them (spd/csrc/panel_api.h, QRows): per block of 32 inputs the scale
    dx = largest |x| / 32767 and codes round(x / dx) (ties to even), in float32 as the kernel computes them; returns
    codes [M, K / 32, 32] and dx [M, K / 32] as float64."""
    blocks_of = x.reshape(x.shape[0], -1, 32)
    dx = blocks_of.abs().amax(-1) / 32767.0
    inverse = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    codes = torch.round(blocks_of * inverse.unsqueeze(-1)).clamp(-32767, 32767)
    return codes.double(), dx.double()


def defined_product(x: torch.Tensor, held: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The product the kernel defines, in float64: per block d dx sum(q qx) (+ m dx sum(qx)), summed over blocks;
    and the size of its terms (what float32 rounds)."""
    codes, dx = input_codes(x)                                                      # [M, B, 32], [M, B]
    if "q8" in held:
        w, m = held["q8"].double(), None                                            # [N, B, 32]
    else:
        words = held["q"].to(torch.int64) & 0xFFFFFFFF
        w, m = ((words.unsqueeze(-1) >> (4 * torch.arange(8))) & 15).flatten(2).double(), held["m"].double()
    scale = held["d"].double().unsqueeze(0) * dx.unsqueeze(1)                      # [M, N, B]
    terms = [scale * torch.einsum("mbt,nbt->mnb", codes, w),
             scale.abs() * torch.einsum("mbt,nbt->mnb", codes.abs(), w.abs())]
    if m is not None:
        shift = m.unsqueeze(0) * (dx * codes.sum(-1)).unsqueeze(1)
        terms = [terms[0] + shift, terms[1] + shift.abs()]
    return terms[0].sum(-1), terms[1].sum(-1)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("d_in,d_out", [(576, 1536), (1536, 576), (64, 37), (96, 130), (32, 8)])
def test_a_product_from_blocks_has_a_rows_bits_at_every_row_count_and_the_dequantized_weights_value(d_in, d_out, bits,
                                                                                                     level):
    g = torch.Generator().manual_seed(d_in + d_out + bits)
    weight = torch.randn(d_out, d_in, generator=g)
    held = (q4_blocks if bits == 4 else q8_blocks)(weight)
    dense = blocks.dequantize(held)                                   # [d_out, d_in] float32
    assert (dense - weight).abs().max() < 0.5                          # a quantization of the weight, not noise
    packed, packed_bits = blocks.pack(held, panel.LANES[level])
    assert packed_bits == bits
    x, b = torch.randn(30, d_in, generator=g), torch.randn(d_out, generator=g)
    alone = torch.cat([panel.product_blocks(x[i: i + 1], packed, d_out, b, level, bits) for i in range(len(x))])
    for rows in range(1, len(x) + 1):          # every tile shape, and the remainders after them
        assert torch.equal(panel.product_blocks(x[:rows], packed, d_out, b, level, bits), alone[:rows]), rows
    # the kernel's own arithmetic up to float32 rounding, and so the dequantized weight's product up to the inputs'
    # 16-bit codes
    exact, size = defined_product(x, held)
    assert ((alone.double() - b.double() - exact).abs() / (size + 1)).max() < 1e-6
    dense_exact = x.double() @ dense.double().T + b.double()
    scale = x.double().abs() @ dense.double().abs().T + 1
    assert ((alone.double() - dense_exact).abs() / scale).max() < 1e-4


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bits", [4, 8])
def test_scales_are_read_as_the_files_halves_subnormal_and_signed_zero_included(bits, level):
    """d and m are packed as halves (the file's own): the kernel's conversion is exact for every half, so the product
    is the one its arithmetic defines (up to float32 rounding) even for subnormal scales, the largest half and a
    minimum of -0."""
    g = torch.Generator().manual_seed(bits)
    held = (q4_blocks if bits == 4 else q8_blocks)(torch.randn(64, 96, generator=g))
    odd = torch.tensor([2.0 ** -24, 2.0 ** -20, 3 * 2.0 ** -16, 6.1e-5, -0.0, 65504.0]).half().float()
    held["d"] = odd[torch.arange(held["d"].numel()) % len(odd)].view_as(held["d"])
    if bits == 4:
        held["m"] = -odd[torch.arange(held["m"].numel()) % len(odd)].view_as(held["m"])
    packed, _ = blocks.pack(held, panel.LANES[level])
    x = torch.randn(5, 96, generator=g)
    got = panel.product_blocks(x, packed, 64, None, level, bits).double()
    exact, size = defined_product(x, held)
    assert ((got - exact).abs() / (size + 1e-30)).max() < 1e-6
    held["d"] = held["d"] + 1e-9                # not a half: not a GGUF's blocks
    with pytest.raises(ValueError, match="not a half"):
        blocks.pack(held, panel.LANES[level])


@pytest.mark.skipif("avx512" not in LEVELS, reason="no AVX-512 here")
@pytest.mark.parametrize("bits", [4, 8])
def test_the_avx512_levels_dot_products_are_the_same_integers_with_vnni_or_without(bits):
    """Where the CPU has AVX-512 VNNI the level's 16-bit dot products are its instructions, else a multiply-add of
    pairs and an add: the same integers, so the same bits (the other one is what a CPU without VNNI runs)."""
    g = torch.Generator().manual_seed(40 + bits)
    held = (q4_blocks if bits == 4 else q8_blocks)(torch.randn(300, 576, generator=g))
    packed, _ = blocks.pack(held, panel.LANES["avx512"])
    x = torch.randn(13, 576, generator=g) * torch.logspace(-3, 3, 576)     # codes across the whole 16-bit range
    first = panel.product_blocks(x, packed, 300, None, "avx512", bits)
    was = panel.extension().use_vnni(not panel.extension().use_vnni(True))
    try:
        assert torch.equal(panel.product_blocks(x, packed, 300, None, "avx512", bits), first)
    finally:
        panel.extension().use_vnni(was)


def test_the_self_check_covers_the_blocks_and_refuses_a_blocks_kernel_that_breaks_the_rule(monkeypatch, tmp_path):
    monkeypatch.setenv("SPD_CACHE_DIR", str(tmp_path))
    panel.panels_invariant.cache_clear()
    shapes = ((576, 1536), (64, 37))
    real = panel.product_blocks

    def by_row_count(x, panels, n_out, bias, level, bits):      # another order from 4 rows up: the bits change
        if x.reshape(-1, x.shape[-1]).shape[0] < 4:
            return real(x, panels, n_out, bias, level, bits)
        return real(x * (1 + 2.0 ** -20), panels, n_out, bias, level, bits)
    try:
        assert all(panel.panels_invariant(shapes, level) for level in LEVELS)
        panel.panels_invariant.cache_clear()
        monkeypatch.setenv("SPD_CACHE_DIR", str(tmp_path / "fresh"))
        monkeypatch.setattr(panel, "product_blocks", by_row_count)
        assert not any(panel.panels_invariant(shapes, level) for level in LEVELS)
        assert panel.level_for(shapes) is None
    finally:
        panel.panels_invariant.cache_clear()


def with_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """Every Linear's weight replaced by its Q4_1 blocks' dequantized values (the head, tied or not, by Q8_0's), and
    the blocks attached as spd.targets.blocks.attach attaches a GGUF's."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            held = (q8_blocks if name == "lm_head" else q4_blocks)(module.weight.detach())
            with torch.no_grad():
                module.weight.copy_(blocks.dequantize(held))
            module.__dict__["_blocks"] = held, module.weight._version
    return model


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(1.0, top_k=8)], ids=["greedy", "keyed T=1"])
def test_drafted_decoding_over_blocks_is_the_targets_own_decoding(family, params, level, monkeypatch):
    monkeypatch.setenv(panel.LEVEL_ENV, level)
    target = with_blocks(tiny_model(family, seed=1, tied=not params.greedy))
    staged = StagedTarget(target, 1)
    assert staged.weights == "q4" and staged.panel_level == level
    assert all(m.__dict__["_panels"][5] in (4, 8) for m in target.modules() if isinstance(m, panel.PanelLinear))
    kept, verified = priced_drafts_equal_ar(target, staged, params, 90)
    assert 0 < kept < verified


@pytest.mark.parametrize("overrides,message", [
    (["target=tiny-llama", "weights=q4"], "target=tiny-llama is not a .gguf file"),
    (["weights=q4", "dtype=bfloat16"], "weights=q4 runs float32 rows on a CPU"),
    (["weights=q8"], "weights"),
    (["weights=q4", "method=ar", "runtime=device", "compile=true"], "torch.compile cannot trace"),
])
def test_weights_q4_without_blocks_to_read_is_refused_in_one_line(overrides, message, tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "spd.cli", "generate", "hi", *overrides], capture_output=True,
                          text=True, cwd=tmp_path, env={**__import__("os").environ, "SPD_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in done.stderr
    assert not list(tmp_path.rglob("*.safetensors"))              # nothing loaded, nothing written
