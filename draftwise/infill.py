"""Fill-in-the-middle: the code between a prefix and a suffix, for models trained for it.

Code models learn infilling with three special tokens, in the "prefix, suffix, middle" order
(Bavarian et al. 2022, "Efficient Training of Language Models to Fill in the Middle"): the
prompt is <fim_prefix> PREFIX <fim_suffix> SUFFIX <fim_middle>, and what the model writes next
is the middle, up to an end-of-text token. Qwen2.5-Coder spells them <|fim_prefix|>,
<|fim_suffix|>, <|fim_middle|>; StarCoder-style vocabularies <fim_prefix>, ... A middle copies
much of its surroundings (names, arguments, the suffix's next lines), which is where `ngram`
drafts pay.
"""

from __future__ import annotations

from draftwise.errors import PromptError

# (prefix, suffix, middle) tokens, and the tokens that end a middle besides the tokenizer's EOS.
SPELLINGS = (
    (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>")),
    (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<|endoftext|>", "<fim_pad>", "<file_sep>", "<repo_name>")),
)


def infill_prompt(tokenizer, prefix: str, suffix: str) -> tuple[list[int], tuple[int, ...]]:
    """The prompt's token ids for the middle between prefix and suffix, and the token ids that end
    it (pass them as SamplingParams.stop_token_ids). A PromptError where the vocabulary has no
    fill-in-the-middle tokens."""
    vocabulary = tokenizer.get_vocab()
    for markers, ends in SPELLINGS:
        if all(marker in vocabulary for marker in markers):
            start, middle_after, middle = (vocabulary[marker] for marker in markers)

            def encode(text: str) -> list[int]:
                return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

            ids = [start, *encode(prefix), middle_after, *encode(suffix), middle]
            stops = {vocabulary[token] for token in (*ends, *markers) if token in vocabulary}
            if tokenizer.eos_token_id is not None:
                stops.add(tokenizer.eos_token_id)
            return ids, tuple(sorted(stops))
    raise PromptError("fill-in-the-middle (a suffix) needs a model trained for it, whose vocabulary has "
                      "<|fim_prefix|>, <|fim_suffix|> and <|fim_middle|> (e.g. qwen2.5-coder-1.5b); this model's "
                      "has none: send the prefix alone.")
