"""The official ``openai`` client exercises each feature of the OpenAI API through a real
router (kv_aware: it tokenizes and hashes the prompt) in front of a real worker on the tiny
model: logprobs and top_logprobs, echo with prompt logprobs, n with per-choice seeds,
lists of prompts, stop lists, usage in streams, and a 400 naming every field not honoured."""

from __future__ import annotations

import math
import subprocess
from collections.abc import Iterator

import openai
import pytest

from kvserve.router.local_fleet import KVSERVE_COMMAND, LocalFleet
from kvserve.router.ports import free_port
from tests.support.metrics_text import samples

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    model = tmp_path_factory.mktemp("tiny-model") / "tiny"
    subprocess.run(
        [*KVSERVE_COMMAND, "make-tiny-model", str(model)], check=True, capture_output=True
    )
    fleet = LocalFleet(
        model, workers=1, policy="kv_aware", host="127.0.0.1", port=free_port(),
        log_dir=tmp_path_factory.mktemp("fleet-logs"),
        worker_args=["--block-size", "16", "--num-blocks", "512", "--device", "cpu"],
    )  # fmt: skip
    fleet.start(timeout_s=120)
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def client(fleet: LocalFleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0)


MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog. A cache keeps what was computed"


def worker_metric(fleet: LocalFleet, name: str) -> float:
    worker = next(p for p in fleet.processes if p.name != "router")
    return samples(worker.url + "/metrics").get((name, frozenset()), 0.0)


def test_completion_logprobs_in_the_legacy_shape(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and response.usage is not None
    assert len(logprobs.tokens) == response.usage.completion_tokens == 6
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(6)]
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert 1 <= len(top) <= 3 and value <= 0
        assert math.isclose(max(top.values()), value, abs_tol=TOLERANCE)  # greedy: the best
        assert top[token] == value


def test_echo_scores_the_prompt_alone_or_before_an_answer(client: openai.OpenAI) -> None:
    """echo with max_tokens 0 scores the prompt only; with max_tokens 1 the same entries
    are followed by the answer's, which is what the answer has without echo."""
    ids = [5, 17, 300, 42, 99, 7, 250, 31]
    alone = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    both = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=2, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    plain = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, logprobs=2, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    echo, echo_then_answer, answer = (r.choices[0].logprobs for r in (alone, both, plain))
    assert echo is not None and echo_then_answer is not None and answer is not None
    assert alone.usage is not None and alone.usage.completion_tokens == 0
    assert alone.choices[0].finish_reason == "length"
    assert len(echo.tokens) == len(ids) and echo.token_logprobs[0] is None
    # Keyed by token text: two byte tokens that both decode to U+FFFD share a key.
    assert echo.top_logprobs[0] is None and all(1 <= len(t) <= 2 for t in echo.top_logprobs[1:])
    assert echo_then_answer.tokens == echo.tokens + answer.tokens
    for got, want in zip(
        echo_then_answer.token_logprobs[1:], echo.token_logprobs[1:] + answer.token_logprobs,
        strict=True,
    ):  # fmt: skip
        assert math.isclose(got, want, abs_tol=TOLERANCE)
    assert both.choices[0].text == alone.choices[0].text + plain.choices[0].text


def test_echo_with_generation_prepends_the_prompt(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.text.startswith(PROMPT)
    assert response.usage is not None and choice.logprobs is not None
    total = response.usage.prompt_tokens + response.usage.completion_tokens
    assert len(choice.logprobs.tokens) == total
    assert choice.logprobs.token_logprobs[0] is None
    assert all(v is not None for v in choice.logprobs.token_logprobs[1:])
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == choice.logprobs.tokens


def test_n_choices_fork_and_reproduce_their_seeds(client: openai.OpenAI, fleet: LocalFleet) -> None:
    forked_before = worker_metric(fleet, "kvserve_forked_choices_total")
    response = client.completions.create(
        model=MODEL, prompt=PROMPT * 3, max_tokens=8, n=4, seed=11, temperature=1.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.usage is not None and response.usage.completion_tokens == 32
    texts = [c.text for c in response.choices]
    assert len(set(texts)) > 1
    for i in (0, 2):  # choice i is seeded seed + i
        alone = client.completions.create(
            model=MODEL, prompt=PROMPT * 3, max_tokens=8, seed=11 + i, temperature=1.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert alone.choices[0].text == texts[i]
    assert worker_metric(fleet, "kvserve_forked_choices_total") - forked_before == 3


def test_best_of_returns_the_choices_with_the_highest_logprob(client: openai.OpenAI) -> None:
    """best_of=3, n=2: the two of seeds 5, 6, 7 whose sampled tokens are likeliest."""
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0}
    best = client.completions.create(
        **kwargs, n=2, best_of=3, seed=5, extra_body={"ignore_eos": True}
    )
    assert best.usage is not None and best.usage.completion_tokens == 3 * 6  # all generated
    alone = []
    for seed in (5, 6, 7):
        choice = client.completions.create(**kwargs, seed=seed, logprobs=0).choices[0]
        assert choice.logprobs is not None
        alone.append((-sum(choice.logprobs.token_logprobs), seed, choice.text))
    expected = [text for _, _, text in sorted(alone)[:2]]
    assert [c.text for c in best.choices] == expected
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None


def test_a_list_of_prompts_gets_one_choice_each_in_order(client: openai.OpenAI) -> None:
    prompts = ["Hello there", "The cache keeps", "A router"]
    batch = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in batch.choices] == [0, 1, 2]
    singles = [
        client.completions.create(
            model=MODEL, prompt=p, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
        for p in prompts
    ]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles if s.usage)
    assert batch.usage.completion_tokens == 12
    tokens = client.completions.create(
        model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, n=2, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in tokens.choices] == [0, 1, 2, 3]
    assert tokens.choices[0].text == tokens.choices[1].text  # greedy forks agree
    # Prompt tokens once per prompt (token ids: no BOS added), completion tokens per choice.
    assert tokens.usage is not None and tokens.usage.prompt_tokens == 3 + 2
    assert tokens.usage.completion_tokens == 4 * 2


def test_stop_list_and_stream_with_usage(client: openai.OpenAI) -> None:
    full = (
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = full[4:6]
    stopped = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=["zzzz", stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full[: full.index(stop)]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, n=2, temperature=0, logprobs=1,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and usage.completion_tokens == 10
    texts = {0: "", 1: ""}
    tokens = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            tokens[choice.index] += len(choice.logprobs.tokens) if choice.logprobs else 0
    assert texts[0] == texts[1] == full[: len(texts[0])] and texts[0]
    assert tokens == {0: 5, 1: 5}


def test_chat_logprobs_streamed_and_not(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say something about caches."}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, logprobs=True, top_logprobs=3,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = response.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    assert "".join(t.token for t in content) == response.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.bytes == list(entry.token.encode())
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=TOLERANCE)
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, logprobs=True, top_logprobs=3,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    entries = [
        entry
        for chunk in streamed
        for choice in chunk.choices
        if choice.logprobs and choice.logprobs.content
        for entry in choice.logprobs.content
    ]
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in content]


def test_chat_n_choices_streamed_each_open_with_their_role(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name two caches."}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, n=2, seed=3, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert sorted(roles) == [0, 1]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    collected = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, n=2, seed=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [c.message.content for c in collected.choices] == [streamed[0], streamed[1]]


@pytest.mark.parametrize(
    "fields",
    [
        {"function_call": "auto"},
        {"presence_penalty": 0.5},
        {"logit_bias": {"5": 10}},
    ],
)
def test_a_field_not_honoured_is_a_400_naming_it(client: openai.OpenAI, fields: dict) -> None:
    messages = [{"role": "user", "content": "Answer in JSON."}]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **fields)
    (name,) = fields
    assert raised.value.param == name  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=2, extra_body={"made_up_field": 1}
        )
    assert raised.value.param == "made_up_field"  # type: ignore[attr-defined]
