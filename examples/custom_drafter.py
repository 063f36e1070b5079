"""Bring your own drafter: any object with the Drafter protocol's four members works.

Here: a drafter that proposes what followed the current token in a REFERENCE text the answer is
likely to quote (a document, a previous answer, a code file). Run it:

    python examples/custom_drafter.py

The output is exactly plain greedy decoding's (the target verifies every draft token); only the
speed changes. See draftwise/drafters/base.py for the protocol and draftwise/drafters/ngram.py
for a fuller version of the same idea.
"""

from __future__ import annotations

import torch

import draftwise
from draftwise.drafters.base import Draft, empty_draft


class ReferenceDrafter:
    """Proposes the tokens that followed the last committed token's latest occurrence in a reference."""

    sequential = False  # drafting is free: the engine may trim the draft to what pays off

    def __init__(self, tokenizer, reference: str) -> None:
        self.reference = torch.tensor(tokenizer.encode(reference, add_special_tokens=False))

    def begin(self, params, generator, max_length: int) -> None:
        pass  # no per-request state

    def propose(self, context: torch.Tensor, num_draft_tokens: int) -> Draft:
        hits = torch.nonzero(self.reference[:-1] == context[-1]).ravel()
        if hits.numel() == 0:
            return empty_draft()
        start = int(hits[-1]) + 1
        tokens = self.reference[start:start + num_draft_tokens]
        # probs=None: each token is a fixed guess (a point mass), verified losslessly when sampling too.
        # A tree drafter would also pass parents=[...] (draftwise.tree) and scores=[...].
        return Draft(tokens, probs=None, key="reference")

    def rollback(self, num_valid: int) -> None:
        pass  # nothing cached, so nothing to forget


def main() -> None:
    reference = "def area(width, height):\n    \"\"\"Return the area of a rectangle.\"\"\"\n    return width * height\n"
    plain = draftwise.load("smollm2-135m", drafter="none", progress=False)
    drafter = ReferenceDrafter(plain.tokenizer, reference)
    engine = draftwise.load("smollm2-135m", drafter=drafter, progress=False)
    prompt = [{"role": "user", "content": f"Repeat this code exactly:\n\n{reference}"}]
    params = draftwise.SamplingParams(max_new_tokens=60)
    result = engine.generate(prompt, params)
    assert result.token_ids == plain.generate(prompt, params).token_ids  # lossless
    print(result.text)
    print(result.metrics.summary())


if __name__ == "__main__":
    main()
