"""Next-token choice for a batch of rows, each with its own sampling rules.

Greedy rows take the argmax, exactly what ``transformers`` does, so greedy output can
be compared token for token. Random rows go through temperature, top-k and top-p, then
an exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), which draws from ``p``. A
seeded row draws its noise from its own generator, so its samples depend only on its
own logits and seed, never on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.core.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None  # the request's own, when it has a seed
    suppressed_token_ids: Sequence[int] = ()  # e.g. stop tokens below min_tokens
    allowed_tokens: torch.Tensor | None = None  # bool [vocab]: a grammar's mask this step


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """Any integer seed (clients send arbitrary ones); torch takes 64 bits."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % 2**64)
    return generator


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        # Rows without a seed share this one, so an engine built with a seed replays.
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @torch.inference_mode()  # the runner's logits are inference tensors, changed in place
    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """One token id per row of ``logits`` (``[len(rows), vocab]``, modified in place)."""
        for i, row in enumerate(rows):
            if row.suppressed_token_ids:
                logits[i, list(row.suppressed_token_ids)] = -torch.inf
            if row.allowed_tokens is not None:
                logits[i].masked_fill_(~row.allowed_tokens, -torch.inf)
        # max's indices are argmax's (first of ties), and on CPU max is ~2x faster
        chosen = logits.max(dim=-1).indices
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            params = [rows[i].params for i in random_rows]
            probs = _filtered_probs(logits[random_rows], params)
            noise = torch.empty_like(probs)
            unseeded = [j for j, i in enumerate(random_rows) if rows[i].generator is None]
            if unseeded:
                noise[unseeded] = torch.empty_like(probs[unseeded]).exponential_(
                    generator=self.generator
                )
            for j, i in enumerate(random_rows):
                generator = rows[i].generator
                if generator is not None:
                    noise[j].exponential_(generator=generator)
            chosen[random_rows] = (probs / noise).argmax(dim=-1)
        return chosen.tolist()


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (each row its own values)."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature.unsqueeze(1)
    top_k = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
    top_p = [p.top_p for p in params]
    if min(top_k) < logits.shape[1] or min(top_p) < 1.0:
        logits = _top_k_top_p(
            logits, torch.tensor(top_k, device=device), torch.tensor(top_p, device=device)
        )
    return torch.softmax(logits, dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside each row's top-k and its top-p nucleus (the best one survives)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), -torch.inf)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), -torch.inf)
    return torch.full_like(logits, -torch.inf).scatter(1, order, sorted_logits)
