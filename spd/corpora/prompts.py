"""The evaluation prompts shipped inside the package (MT-Bench, GSM8K, HumanEval; 80 each, FastChat format)."""

from __future__ import annotations

import json
from importlib import resources

from spd.errors import UserError

DATASETS = ("mt_bench", "gsm8k", "humaneval")


def load_questions(dataset: str) -> list[dict]:
    """[{"question_id", "category", "turns": [...]}, ...] in file order."""
    if dataset not in DATASETS:
        raise UserError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")
    path = resources.files("spd") / "assets" / "eval" / dataset / "question.jsonl"
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """First-turn protocol: the target's chat template with the generation prompt."""
    return conversation_ids(tokenizer, [{"role": "user", "content": text}])


def conversation_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation through the target's chat template, ending with the generation prompt."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])
