"""What a request adds to the target's logits, lossless under speculation: OpenAI's logit_bias,
presence_penalty and frequency_penalty, and the repetition_penalty of CTRL (Keskar et al.
2019), transformers and vLLM.

logit_bias adds a fixed number to chosen tokens' logits at every position, so every row gets
the same addition. min_new_tokens bans the stop tokens (-inf) in rows that predict an output
token before that count: a row's count is the output so far plus its depth in the draft.

A penalty makes a position's distribution depend on the tokens before it. In a verify forward
each row's context is the committed tokens plus the draft tokens on the path to that row (a
chain's first i, a tree node's ancestors and the node itself), so each row is penalised by
exactly the context it has if its path is accepted: the distribution plain decoding uses at that
position. Verification then runs on the penalised rows unchanged, and its guarantees hold as
they are: greedy output equals plain greedy decoding's, rejection sampling samples the penalised
distribution, coupled sampling gives the same text for a seed.

Per token j, on the raw logits, before temperature and the filters (vLLM's order):
  - logit_bias b_j is added; the stop tokens are banned where the output is still too short;
  - repetition_penalty r, over the prompt AND the output (as transformers and vLLM): a seen
    token's logit is divided by r when positive, multiplied by r otherwise;
  - then, with count_j the times j occurs in the OUTPUT so far (as OpenAI and vLLM):
    logit_j -= frequency_penalty * count_j + presence_penalty * (count_j > 0).
Only the columns of tokens in the context or the draft are touched, each by elementwise
arithmetic on its own row, so a row's result never depends on the other rows (batch invariance).
"""

from __future__ import annotations

import torch

from draftwise.config import SamplingParams
from draftwise.tree import path_mask


@torch.inference_mode()  # the forward's logits are inference tensors: changed in place only in this mode
def penalize(logits: torch.Tensor, params: SamplingParams, context: torch.Tensor, num_prompt: int,
             draft_tokens: torch.Tensor, tree_mask: torch.Tensor | None = None, copy: bool = True,
             stop_ids: frozenset[int] = frozenset()) -> torch.Tensor:
    """Biased and penalised logits [rows, vocab] for a verify forward (or the first token's row).
    context: the committed tokens [L] (the prompt's num_prompt, then the output); draft_tokens [n]
    the forward scored after context[-1]; rows = n + 1, row 0 the last committed token's. tree_mask:
    the forward's ancestor mask [1 + n, 1 + n] (draftwise.tree), None for a chain. copy=False
    changes float32 logits in place (the caller keeps no other use of the raw ones: a copy of
    25 rows of a 152k vocabulary costs 0.8 ms, a third of the rest). stop_ids: the tokens that
    end the output, banned before params.min_new_tokens."""
    rows = logits.shape[0]
    logits = logits.float()
    if copy:
        logits = logits.clone()
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)
        logits[:, list(ids)] += torch.tensor(biases, dtype=torch.float32)
    on_path = path_mask(rows, tree_mask).to(torch.float32)  # [rows, n]: the draft nodes each row's context holds
    num_output = context.shape[0] - num_prompt
    if stop_ids and num_output < params.min_new_tokens:
        too_short = num_output + on_path.sum(dim=1) < params.min_new_tokens  # [rows]
        logits[too_short.nonzero()[:, :1], sorted(stop_ids)] = float("-inf")
    if not params.has_penalties:
        return logits
    seen = torch.cat((context, draft_tokens)).unique()  # sorted ids of every token that may be penalised
    drafted = torch.zeros(draft_tokens.shape[0], seen.shape[0])
    drafted[torch.arange(draft_tokens.shape[0]), torch.searchsorted(seen, draft_tokens)] = 1.0
    output = context[num_prompt:]
    counts = torch.zeros(seen.shape[0]).index_add_(0, torch.searchsorted(seen, output), torch.ones(output.shape[0]))
    counts = counts + on_path @ drafted  # [rows, |seen|]: small integers, exact in float32
    columns = logits[:, seen]
    if params.repetition_penalty != 1.0:
        in_prompt = torch.zeros(seen.shape[0], dtype=torch.bool)
        in_prompt[torch.searchsorted(seen, context[:num_prompt])] = True
        penalised = torch.where(columns > 0, columns / params.repetition_penalty, columns * params.repetition_penalty)
        columns = torch.where(in_prompt | (counts > 0), penalised, columns)
    if params.frequency_penalty or params.presence_penalty:
        columns = columns - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    logits[:, seen] = columns
    return logits
