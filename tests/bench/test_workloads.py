"""Each workload source on small fixtures: lengths, arrivals and — above all — that
prompts share exactly the prefix their structure says they share."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from kvserve.bench.workloads import RequestSpec, WorkloadSpecError, build_workload
from kvserve.bench.workloads.mooncake import read_rows
from kvserve.bench.workloads.spec import DATA_DIR_ENV, data_dir
from tests.support.processes import REPO_ROOT

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MOONCAKE = FIXTURES / "mooncake_small.jsonl"
SHARED_DATA = data_dir()


def common_prefix(a, b) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def units(prompt) -> list:
    """Words of a text prompt, ids of a token prompt: the unit blocks are measured in."""
    return prompt.split() if isinstance(prompt, str) else list(prompt)


def block_lengths(row, block_tokens: int) -> list[int]:
    total = math.ceil(row.input_length * block_tokens / 512)
    full = [block_tokens] * (len(row.hash_ids) - 1)
    return [*full, total - sum(full)]


def expected_shared(row_a, row_b, block_tokens: int) -> int:
    """Blocks with equal hash ids are equal content; a truncated last block is a prefix
    of the full one, after which sharing stops."""
    shared = 0
    lengths = zip(
        block_lengths(row_a, block_tokens), block_lengths(row_b, block_tokens), strict=False
    )
    for ha, hb, (la, lb) in zip(row_a.hash_ids, row_b.hash_ids, lengths, strict=False):
        if ha != hb:
            break
        shared += min(la, lb)
        if la != lb:
            break
    return shared


@pytest.mark.parametrize("mode", ["tokens", "text"])
def test_mooncake_prompts_share_exactly_their_hash_id_prefix(mode: str) -> None:
    rows = read_rows(MOONCAKE)
    specs = list(build_workload(f"mooncake:{MOONCAKE},block_tokens=16,mode={mode}").requests)
    prompts = [units(s.prompt) for s in specs]
    for row, prompt in zip(rows, prompts, strict=True):
        assert len(prompt) == math.ceil(row.input_length * 16 / 512)
    pairs = list(itertools.combinations(range(len(rows)), 2))
    for i, j in pairs:
        assert common_prefix(prompts[i], prompts[j]) == expected_shared(rows[i], rows[j], 16), (
            i,
            j,
        )
    # The fixture covers no sharing, one block, several blocks and a truncated last block.
    assert {expected_shared(rows[i], rows[j], 16) for i, j in pairs} >= {0, 16, 32, 35, 64}


def test_mooncake_text_prompts_share_characters_too() -> None:
    """Text routers compare characters: the shared blocks are the same characters."""
    specs = list(build_workload(f"mooncake:{MOONCAKE},block_tokens=16").requests)
    two_blocks = "".join(" " + word for word in specs[0].prompt.split()[:32])
    assert specs[1].prompt.startswith(two_blocks)
    assert specs[4].prompt.startswith(specs[1].prompt)  # row 1's blocks are all in row 4


def test_mooncake_arrivals_outputs_and_token_range() -> None:
    workload = build_workload(f"mooncake:{MOONCAKE},mode=tokens,vocab=50,max_tokens=30")
    specs = list(workload.requests)
    assert workload.timed and workload.size == 6
    assert [s.arrival_s for s in specs] == [0.0, 0.1, 0.25, 0.4, 0.9, 1.0]
    assert [s.max_tokens for s in specs] == [30, 12, 30, 8, 20, 5]
    assert all(10 <= t < 50 for s in specs for t in s.prompt)
    assert len(specs[0].prompt) == 1500  # block_tokens defaults to the trace's 512


def test_mooncake_is_deterministic_and_limited() -> None:
    spec = f"mooncake:{MOONCAKE},block_tokens=8,mode=tokens"
    assert list(build_workload(spec).requests) == list(build_workload(spec).requests)
    assert len(list(build_workload(spec, limit=2).requests)) == 2


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="needs the real traces ($KVSERVE_DATA_DIR)")
def test_real_mooncake_conversation_slice_keeps_its_sharing() -> None:
    rows = read_rows(SHARED_DATA / "mooncake/conversation_trace.jsonl", limit=120)
    specs = list(build_workload("mooncake-conv:block_tokens=4,mode=tokens", limit=120).requests)
    shared_pairs = 0
    for i, j in itertools.combinations(range(len(rows)), 2):
        expected = expected_shared(rows[i], rows[j], 4)
        assert common_prefix(specs[i].prompt, specs[j].prompt) == expected
        shared_pairs += expected > 0
    assert shared_pairs > 100


def test_azure_arrivals_and_scaled_lengths_without_sharing() -> None:
    workload = build_workload(
        f"azure:{FIXTURES / 'azure_small.csv'},input_scale=0.01,max_tokens=20"
    )
    specs = list(workload.requests)
    assert workload.timed and workload.size == 5
    assert [round(s.arrival_s, 4) for s in specs] == [0.0, 0.052, 0.0982, 1.1407, 2.52]
    assert [len(s.prompt.split()) for s in specs] == [49, 32, 2, 75, 1]
    assert [s.max_tokens for s in specs] == [10, 8, 20, 14, 20]
    assert len({s.prompt for s in specs}) == 5


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="needs the real traces ($KVSERVE_DATA_DIR)")
def test_real_azure_code_trace_reads() -> None:
    specs = list(build_workload("azure-code:input_scale=0.001", limit=50).requests)
    assert len(specs) == 50
    assert all(b.arrival_s >= a.arrival_s for a, b in itertools.pairwise(specs))


def test_mt_bench_items_are_two_turn_chats() -> None:
    workload = build_workload(f"mt-bench:{FIXTURES / 'mt_bench_small.jsonl'},max_tokens=16")
    specs = list(workload.requests)
    assert not workload.timed and workload.size == 3
    assert all(s.is_chat and len(s.user_turns) == 2 and s.max_tokens == 16 for s in specs)
    assert specs[2].user_turns[1] == "Can you parallelize it?"


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="needs the real traces ($KVSERVE_DATA_DIR)")
def test_real_mt_bench_has_80_questions() -> None:
    assert build_workload("mt-bench").size == 80


@pytest.mark.parametrize("mode", ["tokens", "text"])
def test_shared_prefix_requests_share_exactly_their_prefix(mode: str) -> None:
    spec = f"shared-prefix:requests=40,n_prefixes=3,prefix_len=24,suffix_len=8,mode={mode}"
    prompts = [units(s.prompt) for s in build_workload(spec).requests]
    prefixes = {tuple(p[:24]) for p in prompts}
    assert len(prefixes) == 3
    for a, b in itertools.combinations(prompts, 2):
        assert common_prefix(a, b) == (24 if a[:24] == b[:24] else 0)


def test_skewed_popularity_makes_the_first_prefix_hot() -> None:
    def shares(skew: float) -> list[int]:
        spec = (
            f"shared-prefix:requests=2000,n_prefixes=4,prefix_len=8,suffix_len=4,"
            f"mode=tokens,popularity_skew={skew}"
        )
        prompts = [s.prompt[:8] for s in build_workload(spec).requests]
        return [prompts.count(p) for p in dict.fromkeys(prompts)]

    uniform, skewed = sorted(shares(0), reverse=True), sorted(shares(1.5), reverse=True)
    assert len(uniform) == len(skewed) == 4
    assert max(uniform) < 600  # about 500 each
    # Zipf weights 1, 0.354, 0.192, 0.125: the hot prefix carries about 60 % of 2,000.
    assert 1050 < skewed[0] < 1350 and skewed[3] < 250


def test_negative_popularity_skew_is_refused() -> None:
    with pytest.raises(WorkloadSpecError, match="popularity_skew"):
        build_workload("shared-prefix:requests=4,popularity_skew=-1")


def test_few_shot_shares_the_leading_examples() -> None:
    spec = "few-shot:requests=30,pool=5,shots=3,shot_len=6,question_len=4,mode=tokens"
    prompts = [s.prompt for s in build_workload(spec).requests]
    examples = {p[i : i + 6] for p in prompts for i in range(0, 18, 6)}
    assert len(examples) == 5  # drawn from the pool of 5
    for a, b in itertools.combinations(prompts, 2):
        leading = next((k for k in range(3) if a[6 * k : 6 * k + 6] != b[6 * k : 6 * k + 6]), 3)
        assert common_prefix(a, b) == 6 * leading


def test_multi_turn_conversations_share_their_system_prompt() -> None:
    spec = "multi-turn:conversations=6,turns=3,systems=2,system_len=10,user_len=5"
    specs = list(build_workload(spec).requests)
    assert all(len(s.user_turns) == 3 and len(s.system.split()) == 10 for s in specs)
    assert len({s.system for s in specs}) == 2
    assert specs[0].system == specs[2].system != specs[1].system
    assert len({turn for s in specs for turn in s.user_turns}) == 18


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "unknown workload"),
        ("mooncake", "needs a path"),
        ("mooncake:/no/such/file.jsonl", "no file at"),
        (f"mooncake:{MOONCAKE},blocks=3", "unknown key 'blocks'"),
        (f"mooncake:{MOONCAKE},block_tokens=many", "not a valid int"),
        (f"mooncake:{MOONCAKE},mode=chars", "mode must be one of"),
        ("shared-prefix:/tmp/x", "takes no path"),
        ("few-shot:shots=9,pool=3", "need 1 <= shots <= pool"),
    ],
)
def test_bad_specs_are_explained(spec: str, message: str) -> None:
    with pytest.raises(WorkloadSpecError, match=message):
        build_workload(spec)


def test_a_request_spec_is_a_prompt_or_a_chat() -> None:
    with pytest.raises(ValueError, match="either"):
        RequestSpec(arrival_s=0, max_tokens=1)
    with pytest.raises(ValueError, match="either"):
        RequestSpec(arrival_s=0, max_tokens=1, prompt="a", user_turns=("b",))
    with pytest.raises(ValueError, match="system prompt needs a chat"):
        RequestSpec(arrival_s=0, max_tokens=1, prompt="a", system="s")


def test_the_data_folder_does_not_depend_on_the_working_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    here = data_dir()
    monkeypatch.chdir(tmp_path)
    assert data_dir() == here
    assert here.is_absolute() and here.parts[-2:] == ("shared", "data")
    assert (here.parent.parent / REPO_ROOT.name / "src" / "kvserve").is_dir()  # beside the checkout


def test_the_data_folder_variable_wins_and_a_missing_trace_names_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert data_dir() == tmp_path
    with pytest.raises(WorkloadSpecError, match=f"no file at {tmp_path}.*set {DATA_DIR_ENV}"):
        build_workload("mooncake-conv")
