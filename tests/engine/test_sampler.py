import pytest
import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.sampler import Sampler, SamplingRow, seeded_generator

CPU = torch.device("cpu")


def random_logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=seeded_generator(seed, CPU))


def seeded_row(seed: int, **kwargs) -> SamplingRow:
    return SamplingRow(SamplingParams(seed=seed, **kwargs), seeded_generator(seed, CPU))


def test_greedy_is_argmax():
    logits = random_logits(4)
    rows = [SamplingRow(SamplingParams(temperature=0), None) for _ in range(4)]
    assert Sampler(CPU, seed=0).sample(logits.clone(), rows) == logits.argmax(-1).tolist()


def test_suppressed_tokens_are_never_chosen():
    logits = random_logits(1)
    best = int(logits.argmax())
    row = SamplingRow(SamplingParams(temperature=0), None, suppressed_token_ids=(best,))
    assert Sampler(CPU, seed=0).sample(logits, [row]) != [best]


def test_seeded_row_ignores_the_rest_of_the_batch():
    logits = random_logits(3, seed=1)
    alone = Sampler(CPU).sample(logits[1:2].clone(), [seeded_row(42, top_k=20)])
    for _ in range(20):
        rows = [
            SamplingRow(SamplingParams(), None),
            seeded_row(42, top_k=20),
            SamplingRow(SamplingParams(temperature=0), None),
        ]
        assert Sampler(CPU).sample(logits.clone(), rows)[1] == alone[0]


def test_seeded_sequence_is_reproducible_and_seed_dependent():
    logits = random_logits(1, vocab=1000)

    def run(seed: int) -> list[int]:
        row = seeded_row(seed)
        return [Sampler(CPU).sample(logits.clone(), [row])[0] for _ in range(30)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_sampling_follows_the_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    logits = probs.log()
    sampler = Sampler(CPU, seed=3)
    row = SamplingRow(SamplingParams(), None)
    counts = torch.bincount(
        torch.tensor([sampler.sample(logits.clone(), [row])[0] for _ in range(4000)]),
        minlength=4,
    )
    assert counts[3] == 0
    assert torch.allclose(counts.float() / 4000, probs[0], atol=0.03)


@pytest.mark.parametrize(
    ("kwargs", "allowed"),
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.6}, {0, 1}),  # 0.5 alone is short of 0.6, 0.5 + 0.3 covers it
        ({"top_p": 0.5}, {0}),
        ({"top_k": 3, "top_p": 0.01}, {0}),
    ],
)
def test_top_k_and_top_p_restrict_the_support(kwargs, allowed):
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    sampler = Sampler(CPU, seed=5)
    row = SamplingRow(SamplingParams(**kwargs), None)
    seen = {sampler.sample(logits.clone(), [row])[0] for _ in range(500)}
    assert seen == allowed


def test_low_temperature_sharpens_and_high_flattens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    sampler = Sampler(CPU, seed=9)

    def share_of_best(temperature: float) -> float:
        row = SamplingRow(SamplingParams(temperature=temperature), None)
        picks = [sampler.sample(logits.clone(), [row])[0] for _ in range(2000)]
        return picks.count(0) / len(picks)

    assert share_of_best(0.2) > 0.95
    assert 0.3 < share_of_best(100.0) < 0.4


def test_per_row_parameters_in_one_batch():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(3, 1)
    rows = [
        SamplingRow(SamplingParams(top_k=1), None),
        SamplingRow(SamplingParams(), None),
        SamplingRow(SamplingParams(temperature=0), None, suppressed_token_ids=(0,)),
    ]
    sampler = Sampler(CPU, seed=1)
    picks = [sampler.sample(logits.clone(), rows) for _ in range(300)]
    assert {p[0] for p in picks} == {0}
    assert {p[1] for p in picks} == {0, 1, 2, 3}
    assert {p[2] for p in picks} == {1}


def test_any_integer_seed_is_accepted():
    for seed in (-1, 2**64 + 5, -(2**70)):
        row = seeded_row(seed)
        assert 0 <= Sampler(CPU).sample(random_logits(1), [row])[0] < 50
    assert seeded_generator(2**64 + 5, CPU).initial_seed() == 5
