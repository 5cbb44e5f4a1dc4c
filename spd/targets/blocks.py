"""A GGUF target's products read from the file's own 4- and 8-bit blocks (`weights=q4`), not from float32 copies.

Why: a one-row forward of the float32 SmolLM2 streams its 513 MiB of weights from memory for every token; the
GGUF's blocks hold the same weights in ~5 bits each (Q4_1: 32 weights share an fp16 scale d and minimum m, w =
q * d + m; the tied head is Q8_0: w = q * d). The panel kernel (spd/csrc/panel_kernel.h) takes each row's inputs
as 16-bit codes and a scale a block of 32, multiplies the weights' codes by them as integers (exact, so in any
order) and applies the scales and minimum once a block (d dx sum(q qx) + m dx sum(qx)): the dequantized weight's
product up to the inputs' codes (within ~2e-5 of the largest), and a row's bits the same at every row count. So `weights=q4` is a target of its own, with its own row arithmetic around the products too
(spd.targets.own_rows) — every method at weights=q4 decodes its AR's tokens. `write_blocks` checks per tensor that
the blocks dequantized equal the weight transformers loads from the file, bit for bit, and refuses a file where they
do not (the blocks are that file's weights, not another quantization of them).

The blocks are read once per weight cache (spd.targets.weight_cache) into `blocks.safetensors` beside the float32
weights, by their HF parameter names and with the rows in the HF order (GGUF stores a Llama's q and k rows
permuted), so a pipeline stage's process loads only its own layers' blocks.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from spd.errors import UserError

BLOCKS_FILE = "blocks.safetensors"
GROUP = 32                        # weights a block (Q4_1 and Q8_0)


def _hf_names(reader, path: str, model) -> tuple[dict[str, str], object]:
    """{GGUF tensor name: HF parameter name} and the tensor processor transformers loads this architecture with."""
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, load_gguf_checkpoint, read_field)

    architecture = read_field(reader, "general.architecture")[0]
    config = load_gguf_checkpoint(path, return_tensors=False)["config"]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    return get_gguf_hf_weights_map(model, processor), processor


def read_blocks(path: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The Q4_1 and Q8_0 tensors of the GGUF file at `path`, by `model`'s parameter names: for a 4-bit weight
    [N, K], `<name>.d` and `<name>.m` [N, K / 32] float32 and `<name>.q` [N, K / 32, 4] int32 (word u holds the
    block's weights 8u .. 8u + 7, weight 8u + j in bits 4j .. 4j + 3); for an 8-bit one `<name>.d` and `<name>.q8`
    [N, K / 32, 32] int8."""
    import gguf

    reader = gguf.GGUFReader(path)
    names, processor = _hf_names(reader, path, model)
    kinds = {gguf.GGMLQuantizationType.Q4_1: 20, gguf.GGMLQuantizationType.Q8_0: 34}
    out = {}
    for tensor in reader.tensors:
        size = kinds.get(tensor.tensor_type)
        if size is None:
            continue
        raw = torch.from_numpy(np.array(tensor.data, copy=True))         # [N, K / 32 * size] bytes
        rows = raw.shape[0]
        # the row order transformers loads the tensor in (a Llama's q and k rows are stored permuted)
        result = processor.process(weights=np.arange(rows, dtype=np.float64)[:, None], name=tensor.name,
                                   tensor_key_mapping=names, parsed_parameters={"config": {}, "tensors": {}})
        if result.name not in names:
            continue
        order = torch.from_numpy(np.asarray(result.weights).reshape(-1).astype(np.int64))
        if sorted(order.tolist()) != list(range(rows)):
            continue     # a tensor transformers reshapes in some other way: it keeps its float32 copy
        blocks = raw[order].view(rows, -1, size)                            # [N, K / 32, size]
        name = names[result.name]
        out[f"{name}.d"] = blocks[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
        if size == 20:
            out[f"{name}.m"] = blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
            nibbles = torch.cat([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], -1).to(torch.int64)   # [N, B, 32]
            words = (nibbles.view(rows, -1, 4, 8) << (4 * torch.arange(8))).sum(-1)                 # [N, B, 4]
            out[f"{name}.q"] = words.to(torch.int32)     # bit patterns below 2^32, kept as they are
        else:
            out[f"{name}.q8"] = blocks[..., 2:].contiguous().view(torch.int8)
    return out


def write_blocks(path: str, model: torch.nn.Module, directory: str) -> None:
    """blocks.safetensors in a weight cache `directory` from the GGUF file at `path`, each weight's blocks checked to
    dequantize to `model`'s weight (the float32 target read from the same file) bit for bit; written whole or not
    at all."""
    blocks = read_blocks(path, model)
    weights = dict(model.named_parameters(remove_duplicate=False))
    for name, own in by_weight(blocks.items()).items():
        if not torch.equal(dequantize(own), weights[name]):
            raise UserError(f"weights=q4: the blocks of {name} in {os.path.basename(path)} do not dequantize to the "
                            "weight transformers loads from it; use weights=float32")
    if not blocks:
        raise UserError(f"weights=q4: {os.path.basename(path)} holds no Q4_1 or Q8_0 tensor (the types the 4-bit "
                        "products read); use weights=float32")
    fd, tmp = tempfile.mkstemp(prefix=".tmp-blocks-", dir=directory)
    os.close(fd)
    try:
        save_file(blocks, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(directory, BLOCKS_FILE))
    except BaseException:
        os.unlink(tmp)
        raise


def dequantize(blocks: dict[str, torch.Tensor]) -> torch.Tensor:
    """One weight's blocks as float32 [N, K], in GGUF's reference arithmetic (q * d, then + m)."""
    d = blocks["d"].unsqueeze(-1)                                             # [N, B, 1]
    if "q8" in blocks:
        return (blocks["q8"].float() * d).flatten(1)
    words = blocks["q"].to(torch.int64) & 0xFFFFFFFF                          # [N, B, 4]
    q = ((words.unsqueeze(-1) >> (4 * torch.arange(8))) & 15).flatten(2)     # [N, B, 32]
    return (q.float() * d + blocks["m"].unsqueeze(-1)).flatten(1)


def _rows_to_panels(t: torch.Tensor, lanes: int) -> torch.Tensor:
    # [N, B, ...] -> [P, B, ..., lanes], rows past N zero (a zero block: d = m = 0, every weight 0)
    rows = t.shape[0]
    padded = t.new_zeros((-(-rows // lanes) * lanes,) + t.shape[1:])
    padded[:rows] = t
    panels = padded.view((-1, lanes) + t.shape[1:])
    return panels.permute(0, *range(2, panels.dim()), 1).contiguous()


def _halves(t: torch.Tensor) -> torch.Tensor:
    # a block's scale (or minimum) as the file's half again: exact, or the blocks are not a GGUF's
    half = t.to(torch.float16)
    if not torch.equal(half.float(), t):
        raise ValueError("a block's d or m is not a half: these blocks do not come from a GGUF file")
    return half


def pack(blocks: dict[str, torch.Tensor], lanes: int) -> tuple[torch.Tensor, int]:
    """One weight's blocks as the kernel's panels [P, K / 32, bytes a block] uint8 (d and m as halves, the file's
    own), and their bits (4 or 8). A feature's codes go in 32-bit words whose 16-bit halves a dot product of
    16-bit pairs reads (spd/csrc/panel_kernel.h): Q4_1's weights 8u + 2s and 8u + 2s + 1 in nibble s of word u's
    lower and upper half; Q8_0's bytes 4c, 4c + 2, 4c + 1, 4c + 3 in word c."""
    if "q" in blocks:
        codes = (blocks["q"].to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1) >> (4 * torch.arange(8)) & 15   # [N, B, 4, 8]
        shifts = 4 * torch.arange(4)
        words = ((codes[..., 0::2] << shifts).sum(-1) | (codes[..., 1::2] << (shifts + 16)).sum(-1))     # [N, B, 4]
        parts = [_halves(blocks["d"]), _halves(blocks["m"]), (words - (words >> 31 << 32)).to(torch.int32)]
    else:
        shape = blocks["q8"].shape[:-1]
        q8 = blocks["q8"].reshape(*shape, 8, 2, 2).transpose(-1, -2).reshape(*shape, 8, 4)   # 4c, 4c + 2, 4c + 1, ..
        parts = [_halves(blocks["d"]), q8.contiguous().view(torch.int32).squeeze(-1)]        # [N, B, 8]
    panels = [_rows_to_panels(p, lanes) for p in parts]
    P, B = panels[0].shape[:2]
    packed = torch.cat([p.view(torch.uint8).reshape(P, B, -1) for p in panels], -1).contiguous()
    return packed, 4 if "q" in blocks else 8


def by_weight(flat) -> dict[str, dict[str, torch.Tensor]]:
    """{"<name>.<part>": tensor} pairs (read_blocks' keys) as {parameter name: {part: tensor}}."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in flat:
        name, part = key.rsplit(".", 1)
        out.setdefault(name, {})[part] = tensor
    return out


def load_blocks(directory: str, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter name: its blocks} for the parameters among `names` that the cache holds blocks of."""
    wanted = set(names)
    with safe_open(os.path.join(directory, BLOCKS_FILE), framework="pt", device="cpu") as f:
        return by_weight((key, f.get_tensor(key)) for key in f.keys() if key.rsplit(".", 1)[0] in wanted)


def blocked(model: torch.nn.Module, directory: str, wanted=lambda name: True) -> list[tuple[torch.nn.Module, str]]:
    """Every nn.Linear of `model` whose weight the cache holds blocks of and `wanted` accepts a name of, with the
    name they are held under (a tied head's: its embedding's, the one parameter under two names)."""
    with safe_open(os.path.join(directory, BLOCKS_FILE), framework="pt", device="cpu") as f:
        held = {key.rsplit(".", 1)[0] for key in f.keys()}
    names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    tied = getattr(model.config, "tie_word_embeddings", False)
    out = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            known = names.get(id(module.weight), [])
            if tied and "lm_head.weight" in known:      # a stage holding the head but not the embedding
                known = known + ["model.embed_tokens.weight"]
            name = next((n for n in known if n in held), None)
            if name is not None and any(wanted(n) for n in known):
                out.append((module, name))
    return out


def attach(modules: list[tuple[torch.nn.Module, str]], directory: str) -> int:
    """Give each (nn.Linear, name) of `blocked` the blocks held under that name, for spd.targets.panel to multiply
    from (write_blocks proved them equal to the weights; the weight itself may stay on meta, load_parts). Returns
    how many Linears multiply from blocks."""
    found = load_blocks(directory, [name for _, name in modules])
    for module, name in modules:
        module.__dict__["_blocks"] = found[name], module.weight._version
    return len(modules)
