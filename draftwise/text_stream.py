"""Token ids -> text, incrementally: stop strings and safe-to-print deltas."""

from __future__ import annotations


class TextStream:
    """Accumulates generated token ids and decides what text may be shown yet.

    Text is held back while it ends in an incomplete UTF-8 sequence (the tokenizer shows
    U+FFFD) or could still turn into a stop string, so a stream never prints something the
    final text does not contain.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""  # final text so far, cut at a stop string once one appears
        self.num_emitted_chars = 0
        self.stopped = False

    def push(self, token_id: int) -> bool:
        """Add one token; return True if a stop string is now complete."""
        self.token_ids.append(token_id)
        previous_length = len(self.text)
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if self.stop:
            # Only the new text and a stop string's length before it can hold a new match.
            window_start = max(0, previous_length - max(map(len, self.stop)))
            hits = [index for s in self.stop if (index := self.text.find(s, window_start)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        return self.stopped

    def delta(self, final: bool = False) -> str:
        """The text that became safe to show since the last call."""
        safe_end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):
                safe_end = len(self.text.rstrip("\ufffd"))
            for s in self.stop:  # hold back a tail that may be the start of a stop string
                for size in range(min(len(s) - 1, safe_end), 0, -1):
                    if self.text[safe_end - size:safe_end] == s[:size]:
                        safe_end -= size
                        break
        if safe_end <= self.num_emitted_chars:
            return ""
        delta = self.text[self.num_emitted_chars:safe_end]
        self.num_emitted_chars = safe_end
        return delta
