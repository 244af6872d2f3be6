"""The step-time model: its terms, the closed-form decode run, the profiles."""

from __future__ import annotations

import math

import pytest

from kvserve.core.cost_model import PROFILES, CostModel, profile

LLAMA = profile("llama3-8b-h100")


def test_each_term_counts_what_it_names() -> None:
    model = CostModel(
        "t", base_s=1, new_token_s=10, context_token_s=100, attention_pair_s=1000, sequence_s=10000
    )
    # One sequence: 2 new tokens after 3 cached -> context 5, pairs 2 * (3 + 1.5) = 9.
    assert model.step_time([(3, 2)]) == 1 + 20 + 500 + 9000 + 10000


def test_decode_run_equals_single_steps() -> None:
    contexts = [100, 2000, 7]
    steps = 37
    single = sum(LLAMA.step_time((c + j, 1) for c in contexts) for j in range(steps))
    assert math.isclose(LLAMA.decode_run_time(contexts, steps), single, rel_tol=1e-12)
    assert LLAMA.decode_run_time(contexts, 0) == 0.0


def test_llama_profile_is_in_the_published_range() -> None:
    """Batch-1 decode ~6-7 ms per token; an 8k-token prompt well under a second."""
    assert 5e-3 < LLAMA.step_time([(1000, 1)]) < 8e-3
    assert 0.1 < LLAMA.step_time([(0, 8192)]) < 0.5


def test_unknown_profile_and_negative_coefficients_are_refused() -> None:
    with pytest.raises(ValueError, match="choose from"):
        profile("a100-imaginary")
    with pytest.raises(ValueError, match=">= 0"):
        CostModel("bad", -1, 0, 0, 0, 0)
    assert set(PROFILES) >= {"llama3-8b-h100", "tiny"}
