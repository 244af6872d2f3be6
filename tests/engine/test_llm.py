"""The offline API: ``from kvserve import LLM, SamplingParams``."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SYSTEM = "You are a helpful assistant who answers briefly and precisely. " * 4


@pytest.fixture(scope="module")
def llm(tiny_model_dirs) -> LLM:
    return LLM(tiny_model_dirs["qwen2"], block_size=4, num_blocks=256)


def assert_all_blocks_released(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    kv.check()
    assert kv.num_available_blocks == kv.num_blocks
    assert not llm.engine.has_unfinished_requests()


def test_text_and_token_prompts_give_one_result_each(llm):
    tokenizer = llm.get_tokenizer()
    token_prompt = tokenizer.encode("Hello! How are you today?")
    results = llm.generate(["The quick brown fox", token_prompt], GREEDY)
    assert [r.prompt for r in results] == ["The quick brown fox", token_prompt]
    assert results[1].prompt_token_ids == token_prompt
    for result in results:
        assert len(result.token_ids) == 8
        assert result.text == tokenizer.decode(result.token_ids)
        assert (result.finish_reason, result.error, result.num_cached_tokens) == ("length", None, 0)
    single = llm.generate("The quick brown fox", GREEDY)
    assert len(single) == 1 and single[0].token_ids == results[0].token_ids
    assert llm.generate(token_prompt, GREEDY)[0].token_ids == results[1].token_ids
    # A stop string needs the text every step, though LLM otherwise detokenizes once.
    text = results[1].text
    stop = text[2:4]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop])
    cut = llm.generate(token_prompt, params)[0]
    assert (cut.text, cut.finish_reason) == (text[: text.index(stop)], "stop")
    assert_all_blocks_released(llm)


def test_shared_prefix_is_served_from_cache(llm):
    first, second = llm.generate([SYSTEM + "Question one?", SYSTEM + "Question two?"], GREEDY)
    # They arrive together: the second waits one step for the first to commit the shared
    # blocks instead of computing them too; the third finds them cached as well.
    third = llm.generate(SYSTEM + "Question three?", GREEDY)[0]
    shared = len(llm.get_tokenizer().encode(SYSTEM))
    assert first.num_cached_tokens == 0
    for later in (second, third):
        assert shared - 4 < later.num_cached_tokens <= len(later.prompt_token_ids) - 1
    assert_all_blocks_released(llm)


def test_per_prompt_params_and_errors_for_one_prompt_only(llm):
    too_long = [10] * 1025
    results = llm.generate(
        ["fine", too_long, "", "also fine"],
        [GREEDY, GREEDY, GREEDY, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)],
    )
    ok, long_result, empty, short = results
    assert len(ok.token_ids) == 8 and len(short.token_ids) == 3
    assert long_result.finish_reason == "error" and "context holds" in long_result.error
    assert empty.finish_reason == "error" and "empty" in empty.error
    assert long_result.token_ids == [] and long_result.text == ""
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["one"], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert_all_blocks_released(llm)


def test_chat_applies_the_template(llm):
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello! How are you today?"},
    ]
    expected = llm.get_tokenizer().encode_chat(conversation)
    (result,) = llm.chat(conversation, GREEDY)
    assert result.prompt_token_ids == expected
    assert result.token_ids == llm.generate(expected, GREEDY)[0].token_ids
    results = llm.chat([conversation, [{"role": "user", "content": "Hi"}]], GREEDY)
    assert len(results) == 2 and results[0].token_ids == result.token_ids


def test_chat_template_refusal_fails_that_conversation_only(llm):
    good = [{"role": "user", "content": "Hi"}]
    bad = [{"role": "user", "content": "Hi"}, "not a message"]
    ok, refused = llm.chat([good, bad], GREEDY)
    assert ok.error is None and len(ok.token_ids) == 8
    assert refused.finish_reason == "error" and "dict" in refused.error


def test_a_failing_step_releases_every_block(tiny_model_dirs, monkeypatch):
    llm = LLM(tiny_model_dirs["qwen2"], block_size=4, num_blocks=64)
    real_forward = llm.engine.runner.forward
    calls = []

    def fail_on_second_step(batch):
        calls.append(len(batch))
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return real_forward(batch)

    monkeypatch.setattr(llm.engine.runner, "forward", fail_on_second_step)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(["one prompt", "another prompt"], GREEDY)
    assert_all_blocks_released(llm)
