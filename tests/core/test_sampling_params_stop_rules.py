"""The stop rules that SamplingParams describe (kvserve.core.stop_checker)."""

import pytest

from kvserve.core.hashing import make_namespace
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.core.stop_checker import find_stop_string, stop_holdback, token_finish_reason

EOS = frozenset({99})


def request_with_output(output: list[int], max_tokens: int = 10, **kwargs) -> Request:
    request = Request(
        "r",
        [1, 2, 3],
        SamplingParams(max_tokens=max_tokens, **kwargs),
        max_tokens=max_tokens,
        namespace=make_namespace("m"),
        block_size=4,
    )
    request.token_ids.extend(output)
    return request


@pytest.mark.parametrize(
    ("output", "kwargs", "reason"),
    [
        ([5], {}, None),
        ([5, 99], {}, "stop"),
        ([5, 99], {"ignore_eos": True}, None),
        ([5, 7], {"stop_token_ids": [7]}, "stop"),
        ([7], {"stop_token_ids": [7], "min_tokens": 2}, None),
        ([5, 99], {"min_tokens": 2}, "stop"),
        ([99], {"min_tokens": 2}, None),
        ([5, 6, 7], {"max_tokens": 3}, "length"),
        ([5, 6, 99], {"max_tokens": 3}, "stop"),
    ],
)
def test_token_finish_reason(output, kwargs, reason):
    assert token_finish_reason(request_with_output(output, **kwargs), EOS) == reason


def test_effective_max_tokens_wins_over_params():
    request = Request(
        "r", [1], SamplingParams(max_tokens=None), max_tokens=2, namespace=b"", block_size=4
    )
    request.token_ids += [5, 6]
    assert token_finish_reason(request, EOS) == "length"


@pytest.mark.parametrize(
    ("text", "stops", "new", "found"),
    [
        ("hello world", ["wor"], 5, 6),
        ("hello world", ["wor"], 3, 6),  # the match ends inside the new characters
        ("hello world", ["wor"], 2, None),  # it ended before them: found earlier
        ("hello world", ["hel"], 3, None),  # already scanned before
        ("abcabc", ["c", "bc"], 3, 4),  # earliest start wins
        ("abc", [], 3, None),
        ("abc", ["b"], 0, None),
    ],
)
def test_find_stop_string(text, stops, new, found):
    assert find_stop_string(text, stops, new) == found


def test_holdback_covers_a_pending_stop_prefix():
    assert stop_holdback(["###", "x"]) == 2
    assert stop_holdback([]) == 0


def test_request_rejects_empty_prompt_and_negative_budget():
    with pytest.raises(ValueError, match="empty"):
        Request("r", [], SamplingParams(), max_tokens=1, namespace=b"", block_size=4)
    with pytest.raises(ValueError, match="max_tokens"):
        Request("r", [1], SamplingParams(), max_tokens=-1, namespace=b"", block_size=4)
    # 0: the prompt is only scored (echo with prompt logprobs)
    assert Request("r", [1], SamplingParams(), max_tokens=0, namespace=b"", block_size=4)
