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
        self._text = ""  # the decoded text of the first _num_decoded ids (cut at a stop string)
        self._num_decoded = 0
        self.num_emitted_chars = 0
        self.stopped = False

    @property
    def text(self) -> str:
        """The final text so far, cut at a stop string once one appears. Decoded when asked
        (a stream asks once a step; answering for `draftwise train` only at the end), not per
        token: each decode reads every id so far, and per token that was 7% of answering 64
        chats at once on SmolLM2 (the tokenizer's decode and its argument checks)."""
        if self._num_decoded != len(self.token_ids) and not self.stopped:
            self._text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            self._num_decoded = len(self.token_ids)
        return self._text

    def push(self, token_id: int) -> bool:
        """Add one token; return True if a stop string is now complete."""
        if not self.stop:
            self.token_ids.append(token_id)
            return False
        previous_length = len(self.text)
        self.token_ids.append(token_id)
        text = self.text
        # Only the new text and a stop string's length before it can hold a new match.
        window_start = max(0, previous_length - max(map(len, self.stop)))
        hits = [index for s in self.stop if (index := text.find(s, window_start)) >= 0]
        if hits:
            self._text = text[: min(hits)]
            self.stopped = True
        return self.stopped

    def delta(self, final: bool = False) -> str:
        """The text that became safe to show since the last call."""
        text = self.text
        safe_end = len(text)
        if not final:
            if text.endswith("\ufffd"):
                safe_end = len(text.rstrip("\ufffd"))
            for s in self.stop:  # hold back a tail that may be the start of a stop string
                for size in range(min(len(s) - 1, safe_end), 0, -1):
                    if text[safe_end - size:safe_end] == s[:size]:
                        safe_end -= size
                        break
        if safe_end <= self.num_emitted_chars:
            return ""
        delta = text[self.num_emitted_chars:safe_end]
        self.num_emitted_chars = safe_end
        return delta
