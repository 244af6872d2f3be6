"""How long one engine step takes on a real GPU, without the GPU: a linear cost model.

The simulator and the cost-model runner (fleet benchmarks without weights) both need step
times that react the way a GPU's do: long prompts cost time in proportion to their
uncached tokens (and quadratically through attention), decode steps cost a fixed weight
read plus a KV read per context token. One step of a batch costs::

    step_s = base_s
           + new_token_s       × (tokens computed this step, all sequences)
           + context_token_s   × (Σ over sequences of the context length read: start + new)
           + attention_pair_s  × (Σ over sequences of new × (start + (new + 1) / 2))
           + sequence_s        × (sequences in the batch)

``base_s`` is the weight read a step pays however small it is (memory bound),
``new_token_s`` the dense matmul FLOPs per token (compute bound), ``context_token_s`` the
KV bytes each sequence reads (decode's memory-bound attention), ``attention_pair_s`` the
causal attention FLOPs of a prefill chunk (each new token attends to everything before
it), ``sequence_s`` per-sequence overhead (sampling, scheduling, kernel launches).

``llama3-8b-h100`` derives each coefficient from published figures, an assumption about
the efficiency reached noted next to each:

- Model: Llama-3-8B (``meta-llama/Meta-Llama-3-8B`` config.json): 32 layers, hidden 4096,
  32 query / 8 KV heads of dim 128, 8.03 B parameters (7.5 B in matmuls), BF16.
- GPU: NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense BF16, 3.35 TB/s HBM3.
- base: 16.06 GB of weights at 80 % of HBM bandwidth (2.68 TB/s) = 6.0 ms per step; this
  is the ~6-7 ms per output token that vLLM and SGLang report for Llama-3-8B at batch 1 on
  one H100.
- new_token: 2 × 7.5 GFLOP per token at 60 % of peak (593 TFLOPS) = 25.3 µs (≈ 40k prompt
  tokens/s, the order vLLM and SGLang reach on long prompts).
- context_token: K and V of one token = 2 × 32 × 8 × 128 × 2 bytes = 128 KiB, read at
  2.68 TB/s = 48.9 ns.
- attention_pair: 4 × 32 layers × 4096 = 524,288 FLOPs per (query, key) pair at 50 % of
  peak (FlashAttention-3 reaches 50-75 % on H100) = 1.06 ns.
- sequence: 20 µs (scheduler and sampler work per sequence in a Python engine).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    """Step-time coefficients of one model on one GPU, in seconds."""

    name: str
    base_s: float
    new_token_s: float
    context_token_s: float
    attention_pair_s: float
    sequence_s: float
    # K and V of one token, all layers: what a prefill/decode transfer moves per token
    kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        coefficients = (
            self.base_s,
            self.new_token_s,
            self.context_token_s,
            self.attention_pair_s,
            self.sequence_s,
        )
        if any(c < 0 for c in coefficients) or self.kv_bytes_per_token < 0:
            raise ValueError(f"cost model {self.name!r}: coefficients must be >= 0")

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        """Seconds for one step computing ``(start, num_new)`` tokens of each sequence."""
        new = context = pairs = sequences = 0.0
        for start, num_new in chunks:
            new += num_new
            context += start + num_new
            pairs += num_new * (start + (num_new + 1) / 2)
            sequences += 1
        return self.step_time_of_totals(new, context, pairs, sequences)

    def step_time_of_totals(
        self, new_tokens: float, context_tokens: float, attention_pairs: float, sequences: float
    ) -> float:
        """The same sum from the batch's totals (for callers that keep them)."""
        return (
            self.base_s
            + self.new_token_s * new_tokens
            + self.context_token_s * context_tokens
            + self.attention_pair_s * attention_pairs
            + self.sequence_s * sequences
        )

    def decode_run_time(self, contexts: Iterable[int], num_steps: int) -> float:
        """Seconds for ``num_steps`` decode steps of a batch whose sequences hold
        ``contexts`` tokens before the first step (closed form, no loop over steps)."""
        if num_steps <= 0:
            return 0.0
        sizes = list(contexts)
        batch = len(sizes)
        # Step j (0-based) computes one token per sequence at position context + j.
        context_sum = sum(sizes) + batch  # of step 0
        per_step_growth = batch
        total_context = num_steps * context_sum + per_step_growth * num_steps * (num_steps - 1) / 2
        # A decode token's attention pairs equal its context length: same sum.
        return (
            num_steps * self.step_time_of_totals(batch, 0, 0, batch)
            + (self.context_token_s + self.attention_pair_s) * total_context
        )


PROFILES: dict[str, CostModel] = {
    "llama3-8b-h100": CostModel(
        name="llama3-8b-h100",
        base_s=6.0e-3,
        new_token_s=25.3e-6,
        context_token_s=48.9e-9,
        attention_pair_s=1.06e-9,
        sequence_s=20e-6,
        kv_bytes_per_token=128 * 1024,
    ),
    # Round numbers for tests: steps of a few milliseconds, prefill 10 µs per token,
    # 1 MB of KV per token (a transfer of 1,000 tokens takes 0.1 s at 10 GB/s).
    "tiny": CostModel(
        name="tiny",
        base_s=2e-3,
        new_token_s=10e-6,
        context_token_s=0.0,
        attention_pair_s=0.0,
        sequence_s=0.0,
        kv_bytes_per_token=1_000_000,
    ),
}


def profile(name: str) -> CostModel:
    """The named profile, or a ValueError listing the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown cost profile {name!r}; choose from {sorted(PROFILES)}") from None
