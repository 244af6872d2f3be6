"""Log-probabilities of chosen tokens and their most likely alternatives.

Computed from the model's raw logits (before temperature, top-k, top-p or any mask), in
float32, as ``log_softmax`` over the whole vocabulary: the numbers an evaluation harness
compares with the model's own, whatever sampling rules the request uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position: the token there, its log-probability, the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@torch.inference_mode()
def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Rows of log-probabilities, in float32 whatever the logits' dtype."""
    return torch.log_softmax(logits.float(), dim=-1)


@torch.inference_mode()
def token_logprobs(
    logprobs: torch.Tensor, token_ids: Sequence[int], num_top: int
) -> list[TokenLogprob]:
    """``token_ids[i]``'s entry of row ``i`` of ``logprobs`` (from :func:`log_softmax`),
    with that row's ``num_top`` best tokens."""
    index = torch.tensor(list(token_ids), dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, index.unsqueeze(1)).squeeze(1).tolist()
    if num_top > 0:
        best = logprobs.topk(num_top, dim=-1)
        values, ids = best.values.tolist(), best.indices.tolist()
    else:
        values = ids = [[] for _ in token_ids]
    return [
        TokenLogprob(token, value, tuple(zip(row_ids, row_values, strict=True)))
        for token, value, row_ids, row_values in zip(token_ids, chosen, ids, values, strict=True)
    ]
