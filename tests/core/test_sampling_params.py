import subprocess
import sys

import pytest

from kvserve.core.sampling_params import InvalidParameterError, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 1.5}, "top_k"),
        ({"seed": "7"}, "seed"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"max_tokens": 0, "logprobs": 1}, "max_tokens"),
        ({"max_tokens": -1, "prompt_logprobs": 1}, "max_tokens"),
    ],
)
def test_invalid_values_name_their_parameter(kwargs, param):
    with pytest.raises(InvalidParameterError) as excinfo:
        SamplingParams(**kwargs)
    assert excinfo.value.param == param
    assert param in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)


def test_max_tokens_zero_only_scores_the_prompt():
    """0 generated tokens is a request only for its prompt logprobs (echo)."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    assert params.max_tokens == 0


def test_mutation_is_caught_by_validate():
    params = SamplingParams()
    params.max_tokens = 0
    with pytest.raises(InvalidParameterError, match="max_tokens"):
        params.validate()


def test_defaults_and_normalisation():
    params = SamplingParams(stop="###", stop_token_ids=[3, 4], max_tokens=None)
    assert params.stop == ("###",)
    assert params.stop_token_ids == (3, 4)
    assert params.max_tokens is None
    assert not params.greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-7).greedy


def test_import_does_not_pull_in_torch():
    code = "import kvserve.core.sampling_params, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
