"""Verified tokens in, text out: incremental detokenization with OpenAI's stop strings.

Text is released only when it can no longer change: a trailing incomplete UTF-8 character (decoded as U+FFFD) and
any tail that could still grow into a stop string are held back until the next token settles them. A stop string
ends the text before it (it is not part of the answer) and ends the decode."""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class StopText:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""       # everything decoded so far (cut at a stop string once one is found)
        self.sent = 0        # characters of `text` already released
        self.stopped = False  # a stop string was found: the decode should end

    def push(self, token: int) -> str:
        """Add one verified token; return the text it releases ("" while it is held back)."""
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._first_stop()
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self._release(cut)
        safe = len(self.text) - self._held_tail()
        return self._release(safe)

    def finish(self) -> str:
        """The decode ended: release whatever was held back."""
        return self._release(len(self.text))

    def _first_stop(self) -> int | None:
        start = max(0, self.sent - max((len(s) for s in self.stop), default=0))
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held_tail(self) -> int:
        """Characters at the end that may still change: an unfinished character, or a prefix of a stop string."""
        text = self.text
        if text.endswith(REPLACEMENT):
            return len(text) - len(text.rstrip(REPLACEMENT))
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out, self.sent = self.text[self.sent: upto], upto
        return out
