"""Held-out evaluation during training: KL and top-1 in the training layout, and an L'acc estimate from a few
greedy SPD decodes of held-out first user turns."""

from __future__ import annotations

import torch

from spd.decoding import Request, eos_ids_of
from spd.drafters.spd_module import ModuleDrafter
from spd.layout import sample_occupancy
from spd.metrics import DecodeStats, pooled_eal
from spd.engine import build_decoder
from spd.methods import PIPELINE
from spd.corpora.prompts import chat_prompt_ids
from spd.train.objective import collate, kd_loss, teacher_pass


@torch.no_grad()
def decode_heldout(make_decoder, staged, tokenizer, heldout_convs, cfg) -> list:
    """Greedy decodes of the first user turns of `cfg.eval_decodes` held-out conversations; their stats."""
    eos = eos_ids_of(staged.config, tokenizer)
    decoder = make_decoder(eos)
    stats = []
    for messages in heldout_convs[: cfg.eval_decodes]:
        first_user = next((m["content"] for m in messages if m["role"] == "user"), None)
        if first_user:
            stats.append(decoder.generate(chat_prompt_ids(tokenizer, first_user), Request(cfg.eval_new_tokens)).stats)
    return stats


@torch.no_grad()
def evaluate(module, staged, tokenizer, heldout_examples, heldout_convs, draft_to_target, cfg) -> dict:
    module.eval()
    g = torch.Generator().manual_seed(cfg.seed)
    kls, agree = [], []
    for ex in heldout_examples:
        batch = collate([ex], tokenizer.pad_token_id or 0)
        teacher = teacher_pass(staged, batch, draft_to_target)
        occ = sample_occupancy(1, staged.n, g, cfg.p_full)
        logits = module(teacher.hidden, occ.to(staged.device), batch["valid"].to(staged.device))
        kl, top1 = kd_loss(logits, teacher)
        kls.append(float(kl))
        agree.append(top1)
    stats: list[DecodeStats] = decode_heldout(
        lambda eos: build_decoder(PIPELINE, staged, eos, ModuleDrafter(module)), staged, tokenizer,
        heldout_convs, cfg)
    module.train()
    top1 = torch.cat(agree).mean().item() if agree else float("nan")
    return {"eval/kl": sum(kls) / max(1, len(kls)), "eval/top1": top1,
            "eval/eal": pooled_eal(stats) if stats else float("nan")}
