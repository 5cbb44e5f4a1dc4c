"""`spd-infer chat`: a conversation on standard input, one line a turn, every answer decoded (generate's default
and keys) over the whole conversation (the target's chat template) and streamed; `/exit` (or end of input) leaves,
`/reset` forgets."""

from __future__ import annotations

import json
import sys

from spd.cli.args import stdin_is_piped
from spd.cli.generate import TextStream, stats_line, with_seed
from spd.engine import open_engine
from spd.errors import UserError
from spd.methods import METHODS
from spd.session import encode_chat

EXIT, RESET = ("/exit", "/quit"), "/reset"


def read_turn(interactive: bool) -> str | None:
    """The next line the user typed, or None at the end of input."""
    if interactive:
        try:
            return input("> ")
        except EOFError:
            return None
    line = sys.stdin.buffer.readline() if hasattr(sys.stdin, "buffer") else sys.stdin.readline().encode()
    if not line:
        return None
    try:
        return line.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise UserError("a chat line on standard input is not UTF-8 text; send UTF-8") from None


def fit(engine, messages: list[dict]) -> list[int]:
    """The conversation's prompt ids; the oldest exchanges are dropped while it overflows the context window."""
    while True:
        try:
            return encode_chat(engine.session, messages, engine.cfg.max_new_tokens)
        except UserError:
            if len(messages) < 3:
                raise
            del messages[:2]  # one user turn and its answer
            print("[chat] the conversation outgrew the context window: the oldest exchange is forgotten",
                  file=sys.stderr)


def chat(cfg, default: bool = False) -> int:
    interactive = not stdin_is_piped()
    with open_engine(cfg, default) as engine:
        if interactive:
            s = engine.session
            how = f"{s.spec.method} n={s.staged.n}" if METHODS[s.spec.method].pipelined else s.spec.method
            print(f"[chat] {s.loaded.name}, {how}: type a message; "
                  "/reset starts over, /exit or Ctrl-D leaves", file=sys.stderr)
        messages: list[dict] = []
        while (line := read_turn(interactive)) is not None:
            text = line.strip()
            if text in EXIT:
                break
            if text == RESET:
                messages.clear()
                continue
            if not text:
                continue
            messages.append({"role": "user", "content": line})
            try:
                prompt_ids = fit(engine, messages)
            except UserError as exc:  # this turn alone is too long: say so and keep the conversation
                messages.pop()
                print(f"spd-infer: error: {exc}", file=sys.stderr)
                continue
            if cfg.json:
                out = with_seed(engine, engine.run(prompt_ids))
                print(json.dumps(out), flush=True)
            else:
                stream = TextStream(engine.session.loaded.tokenizer, sys.stdout)
                out = with_seed(engine, engine.run(prompt_ids, on_token=stream))
                stream.end()
                print(stats_line(out), file=sys.stderr, flush=True)
            messages.append({"role": "assistant", "content": out["text"]})
    return 0
