"""`data.regenerate=true`: rewrite the assistant replies with the target itself.

The module is evaluated on text the target wrote, so it learns most from contexts of that kind. Each
conversation keeps its first user turn (the eval protocol is first-turn too) and gets the target's reply,
greedy or sampled. The result is a JSONL file of OpenAI-style conversations under `data.regenerated_dir`, named
by everything it depends on, so later runs and other configurations reuse it; it is appended batch by batch
(an interrupted run continues where it stopped) and renamed into place only when complete.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
from tqdm import tqdm

from spd.errors import UserError


def regenerated_path(directory: str, fingerprint: str, source: str, conversations: list[list[dict]], settings: dict) -> str:
    digest = hashlib.sha256(json.dumps({"target": fingerprint, "settings": settings,
                                        "prompts": [first_prompt(c) for c in conversations]}).encode())
    name = f"{os.path.splitext(os.path.basename(source))[0]}-{len(conversations)}-{digest.hexdigest()[:12]}.jsonl"
    return os.path.join(directory, name)


def first_prompt(messages: list[dict]) -> list[dict]:
    """System turns and the first user turn: what the target answers."""
    out = []
    for msg in messages:
        out.append(msg)
        if msg["role"] == "user":
            return out
    return []


def _batches(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i: i + size]


@torch.no_grad()
def regenerate(model, tokenizer, conversations: list[list[dict]], path: str, *, temperature: float,
               max_new_tokens: int, max_prompt_tokens: int, batch_size: int, seed: int, log=print) -> str:
    """Write (or finish writing) the regenerated conversations to `path`; return it."""
    if os.path.isfile(path):
        log(f"reusing regenerated data {path}")
        return path
    if temperature < 0:
        raise UserError(f"data.regenerate_temperature={temperature} must be >= 0 (0 = greedy)")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = path + ".partial"
    written = []
    if os.path.isfile(partial):  # keep the complete lines of an interrupted run
        with open(partial) as f:
            for line in f:
                try:
                    written.append(json.dumps(json.loads(line)))
                except json.JSONDecodeError:
                    break
        written = written[: len(written) // batch_size * batch_size]  # whole batches: same batches, same seeds
        with open(partial, "w") as f:
            f.writelines(line + "\n" for line in written)
    done = len(written)
    prompts = []
    for index, conv in enumerate(conversations):
        prompt = first_prompt(conv)
        if not prompt:
            continue
        ids = list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])
        if len(ids) <= max_prompt_tokens:
            prompts.append((index, prompt, ids))
    prompts.sort(key=lambda p: len(p[2]))  # similar lengths share a batch: less padding
    if not prompts:
        raise UserError("no conversation has a user turn short enough to regenerate; raise data.max_length")
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else tokenizer.eos_token_id
    todo = prompts[done:]
    log(f"regenerating {len(prompts)} replies ({done} already written) -> {path}")
    bar = tqdm(total=len(prompts), initial=done, desc="regenerate", unit="conv")
    with open(partial, "a") as out:
        for b, batch in enumerate(_batches(todo, batch_size)):
            start = done + b * batch_size
            width = max(len(ids) for _, _, ids in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (_, _, ids) in enumerate(batch):  # left padding: every prompt ends where generation starts
                input_ids[row, width - len(ids):] = torch.tensor(ids)
                attention[row, width - len(ids):] = 1
            torch.manual_seed(seed * 100003 + start)  # sampled replies depend on (seed, position), not on restarts
            generated = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                       max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                       temperature=temperature if temperature > 0 else None, top_k=None, top_p=None,
                                       pad_token_id=pad, eos_token_id=eos)
            for row, (index, prompt, _) in enumerate(batch):
                reply = tokenizer.decode(generated[row, width:], skip_special_tokens=True).strip()
                out.write(json.dumps({"index": index, "messages": prompt + [{"role": "assistant", "content": reply}]})
                          + "\n")
            out.flush()
            bar.update(len(batch))
    bar.close()
    os.replace(partial, path)
    return path
