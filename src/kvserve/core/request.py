"""A request as the scheduler sees it: its tokens, how many are in the KV cache, its state.

Prompt and generated tokens live in one list because, for the KV cache, they are one
sequence: a preempted request resumes by recomputing ``prompt + output so far``, and
its generated tokens are hashed and shared like prompt tokens.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from kvserve.core.hashing import HashChain
from kvserve.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Token state of one request; the scheduler owns the transitions.

    ``max_tokens`` is the effective output limit (the caller folds the model's context
    length into it), so the scheduler never has to know the model. 0 means the prompt
    is computed (for its logprobs) and nothing is generated.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        namespace: bytes,
        block_size: int,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if max_tokens < 0:
            raise ValueError(f"request {request_id!r} has max_tokens {max_tokens} < 0")
        self.request_id = request_id
        self.params = params
        self.max_tokens = max_tokens
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.hash_chain = HashChain(namespace, block_size)
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.arrival_order = -1  # set by the scheduler
        # Tokens whose K/V are in the request's blocks; the rest are computed next.
        self.num_computed_tokens = 0
        # Leading blocks already committed to the prefix tree.
        self.num_committed_blocks = 0
        # Prompt tokens served from cache at first admission (what the client is told).
        self.num_cached_tokens: int | None = None
        # False while the caller needs the logits of prompt positions (prompt logprobs):
        # a cached block holds K/V, not logits, so admission then matches nothing.
        self.reuse_prefix = True

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_num_tokens(self) -> int:
        """Longest the sequence can get: what the KV pool must be able to hold."""
        return self.num_prompt_tokens + self.max_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token is missing from the KV cache."""
        return self.num_output_tokens > 0 and self.num_uncomputed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def reusable_block_hashes(self) -> list[int]:
        """Hashes of the full blocks strictly before the last token (none while
        ``reuse_prefix`` is off).

        The last token is always recomputed: its logits are needed to sample the next one.
        """
        if not self.reuse_prefix:
            return []
        hashes = self.hash_chain.extend_to(self.token_ids)
        return hashes[: (self.num_tokens - 1) // self.hash_chain.block_size]

    def computed_block_hashes(self) -> list[int]:
        """Hashes of the full blocks whose K/V have been computed (safe to commit)."""
        hashes = self.hash_chain.extend_to(self.token_ids)
        return hashes[: self.num_computed_tokens // self.hash_chain.block_size]
