"""Training conversations: read through `datasets`, rendered with the target's chat template, masked so that
the loss only falls where the next token is an assistant token."""

from __future__ import annotations

import json
import os

import datasets

from spd.errors import UserError
from spd.corpora.sharegpt import SHAREGPT, _sharegpt_file, complete_records, held_out_ids, normalise


def _sharegpt_generator(path: str):
    held_out = held_out_ids()
    for record in complete_records(path):
        if record.get("id") in held_out:
            continue
        msgs = normalise(record)
        if msgs:
            yield {"messages": msgs}


def check_json_lines(path: str) -> None:
    """A JSON document or JSON Lines, else a UserError naming the first bad line (datasets' own error is a
    three-line chain with the useful part in the middle)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise UserError(f"data file {path!r} is not UTF-8 text; give a JSON, JSONL or parquet file") from None
    try:
        json.loads(text)
        return
    except json.JSONDecodeError:
        pass
    # JSON Lines are split at "\n" only: str.splitlines would also split inside a string at U+2028, U+0085, ...,
    # which JSON allows there unescaped
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"data file {path!r}, line {number}: not JSON ({exc.msg} at column {exc.colno}); fix "
                            "that line or give a JSON, JSONL or parquet file") from None


def load_conversations(path: str, limit: int) -> list[list[dict]]:
    """Conversations as role/content lists, through `datasets` (its cache makes reloads cheap)."""
    if path == SHAREGPT:
        source = _sharegpt_file()
        ds = datasets.Dataset.from_generator(_sharegpt_generator, gen_kwargs={"path": source})
    else:
        if not os.path.isfile(path):
            raise UserError(f"data file {path!r} does not exist; give a JSON, JSONL or parquet file, or data.path=sharegpt")
        if os.path.getsize(path) == 0:
            raise UserError(f"data file {path!r} is empty; give a file with conversations")
        kind = "parquet" if path.endswith(".parquet") else "json"
        if kind == "json":
            check_json_lines(path)
        try:
            ds = datasets.load_dataset(kind, data_files=path, split="train")
        except Exception as exc:  # datasets raises many types for unreadable files
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise UserError(f"could not read {path!r} as {kind}: {first}") from None
    rows = []
    for row in ds:
        msgs = normalise(row)
        if msgs:
            rows.append(msgs)
        if len(rows) >= limit:
            break
    if not rows:
        raise UserError(f"no usable conversations in {path!r}: expected ShareGPT (from/value) or OpenAI "
                        "(role/content) turns")
    return rows


def render(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids of the whole conversation and, per token, whether it belongs to an assistant turn.

    Assistant spans are found by rendering growing prefixes (the template must be prefix-stable, as ChatML is).
    """
    def ids(msgs, gen):
        return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True,
                                                  return_dict=True)["input_ids"])

    full = ids(messages, False)
    mask = [False] * len(full)
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before, through = ids(messages[:i], True), ids(messages[: i + 1], False)
        if full[: len(through)] != through or through[: len(before)] != before:
            raise UserError("the chat template is not prefix-stable; assistant tokens cannot be located")
        for j in range(len(before), len(through)):
            mask[j] = True
    return full, mask


def _rendered(tokenizer, conversations) -> list[tuple[list[int], list[bool]] | None]:
    out = []
    for messages in conversations:
        while messages and messages[0]["role"] == "assistant":  # a reply to nothing: no prompt to condition on
            messages = messages[1:]
        out.append(render(tokenizer, messages) if any(m["role"] == "assistant" for m in messages) else None)
    return out


_WORKER_TOKENIZER = None


def _render_chunk(chunk):
    return _rendered(_WORKER_TOKENIZER, chunk)


def render_all(tokenizer, conversations, processes: int | None = None) -> list[tuple[list[int], list[bool]] | None]:
    """`render` of every conversation (None: no assistant turn), in order. Rendering costs ~5-10 ms a conversation
    (every assistant turn renders a prefix), so tens of thousands are split over forked processes where there are
    cores for them: a GPU machine's 16 cores turn minutes into seconds. The result is the same either way."""
    processes = processes or min(os.cpu_count() or 1, 32)
    if processes < 2 or len(conversations) < PARALLEL_FROM:
        return _rendered(tokenizer, conversations)
    global _WORKER_TOKENIZER
    import multiprocessing

    size = -(-len(conversations) // (processes * 4))
    chunks = [conversations[i: i + size] for i in range(0, len(conversations), size)]
    _WORKER_TOKENIZER = tokenizer        # inherited by the forked workers, never pickled
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            return [r for part in pool.map(_render_chunk, chunks) for r in part]
    finally:
        _WORKER_TOKENIZER = None


PARALLEL_FROM = 2000   # conversations below which forking costs more than it saves


def tokenize_conversations(tokenizer, conversations, max_length: int, log=print, processes: int | None = None
                           ) -> list[dict]:
    """Render, mask and length-filter. Error if the template marks no assistant tokens or marks everything."""
    examples, too_long, any_assistant, all_assistant = [], 0, False, True
    for rendered in render_all(tokenizer, conversations, processes):
        if rendered is None:
            continue
        ids, mask = rendered
        any_assistant |= any(mask)
        all_assistant &= all(mask)
        if len(ids) > max_length:
            too_long += 1
            continue
        # loss at position t iff x_{t+1} is an assistant token
        loss_mask = mask[1:] + [False]
        if any(loss_mask):
            examples.append({"input_ids": ids, "loss_mask": loss_mask})
    if not any_assistant:
        raise UserError("the chat template yields no assistant tokens; check the data's roles and the template")
    if all_assistant:
        raise UserError("the chat template marks every token as assistant; the loss mask would train on prompts")
    log(f"{len(examples)} conversations kept, {too_long} longer than {max_length} tokens dropped")
    if not examples:
        raise UserError(f"no conversation fits max_length={max_length}; raise data.max_length")
    return examples
