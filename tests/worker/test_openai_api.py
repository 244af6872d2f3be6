"""The OpenAI endpoints through the official ``openai`` client, against a real worker."""

from __future__ import annotations

import httpx

from kvserve.router.local_fleet import ServerProcess
from tests.worker.worker_process import api, load, openai_client, served_model

IGNORE_EOS = {"ignore_eos": True}


def test_models_lists_the_served_model(worker: ServerProcess) -> None:
    models = openai_client(worker).models.list().data
    assert len(models) == 1
    assert models[0].owned_by == "kvserve"


def test_completion_reports_text_and_usage(worker: ServerProcess) -> None:
    result = openai_client(worker).completions.create(
        model=served_model(worker), prompt="hello there", max_tokens=5, temperature=0,
        extra_body=IGNORE_EOS,
    )  # fmt: skip
    assert result.object == "text_completion"
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 5
    assert result.usage.prompt_tokens > 0
    assert result.usage.total_tokens == result.usage.prompt_tokens + 5
    assert result.usage.prompt_tokens_details.cached_tokens >= 0


def test_streamed_completion_matches_the_unstreamed_one(worker: ServerProcess) -> None:
    client = openai_client(worker)
    kwargs = {"model": served_model(worker), "prompt": [5, 6, 7, 8], "max_tokens": 6}
    kwargs |= {"temperature": 0, "extra_body": IGNORE_EOS}
    whole = client.completions.create(**kwargs)
    stream = client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == 4


def test_stream_ends_with_done_and_has_no_usage_unless_asked(worker: ServerProcess) -> None:
    body = {"model": served_model(worker), "prompt": "hi", "max_tokens": 3, "stream": True}
    with api(worker) as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [event for event in response.text.split("\n\n") if event]
    assert events[-1] == "data: [DONE]"
    assert all('"usage"' not in event for event in events)


def test_chat_completion_streamed_and_not(worker: ServerProcess) -> None:
    client = openai_client(worker)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Say something."}]},
    ]
    kwargs = {"model": served_model(worker), "messages": messages, "temperature": 0}
    whole = client.chat.completions.create(**kwargs, max_completion_tokens=6)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert 0 < whole.usage.completion_tokens <= 6
    stream = client.chat.completions.create(
        **kwargs, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_second_request_sharing_a_long_prefix_reports_cached_tokens(
    worker: ServerProcess,
) -> None:
    client = openai_client(worker)
    model = served_model(worker)
    prefix = [(i * 7) % 200 + 10 for i in range(96)]  # six full blocks
    first = client.completions.create(model=model, prompt=[*prefix, 1], max_tokens=1)
    second = client.completions.create(model=model, prompt=[*prefix, 2], max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 96


def test_seed_makes_sampling_reproducible(worker: ServerProcess) -> None:
    client = openai_client(worker)

    def sample(seed: int) -> str:
        result = client.completions.create(
            model=served_model(worker), prompt="the seed", max_tokens=8, temperature=1.0,
            seed=seed, extra_body=IGNORE_EOS,
        )  # fmt: skip
        return result.choices[0].text

    assert sample(42) == sample(42)
    assert len({sample(seed) for seed in (1, 2, 3, 42)}) > 1


def test_stop_string_cuts_the_text(worker: ServerProcess) -> None:
    client = openai_client(worker)
    kwargs = {"model": served_model(worker), "prompt": "stop here", "max_tokens": 8}
    kwargs |= {"temperature": 0, "extra_body": IGNORE_EOS}
    free = client.completions.create(**kwargs).choices[0].text
    stop = free[2:4]
    assert stop
    stopped = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free[: free.index(stop)]


def test_every_response_names_the_worker(worker: ServerProcess) -> None:
    worker_id = worker.url.removeprefix("http://")
    with api(worker) as client:
        for path in ("/health", "/load", "/metrics", "/v1/models", "/no-such-route"):
            assert client.get(path).headers["x-kvserve-worker"] == worker_id


def test_health_and_idle_load(worker: ServerProcess) -> None:
    health = httpx.get(f"{worker.url}/health").json()
    assert health["status"] == "ok"
    assert health["role"] == "mixed"
    idle = load(worker)
    assert idle["running"] == 0
    assert idle["waiting"] == 0
    assert idle["prefill_tokens"] == 0
    assert idle["total_blocks"] > 0
    assert idle["free_blocks"] + idle["cached_blocks"] == idle["total_blocks"]
    assert idle["evictable_blocks"] == idle["cached_blocks"]  # nothing running pins any
