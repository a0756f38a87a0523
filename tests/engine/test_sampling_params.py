import math

import pytest

from tokenmill.engine.sampling_params import InvalidSamplingParams, SamplingParams


def test_defaults_are_valid():
    SamplingParams().validate()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(temperature=3.0),  # above OpenAI's 2: accepted, like Ollama
        dict(top_p=0.0),
        dict(top_p=1.0),
        dict(min_p=1.0),
        dict(typical_p=0.0),
        dict(top_k=0),
        dict(top_k=1000),
        dict(max_tokens=None),
        dict(max_tokens=1),
        dict(min_tokens=5, max_tokens=5),
        dict(repeat_last_n=-1),
        dict(repeat_last_n=0),
        dict(repeat_penalty=0.5),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(seed=-1),
        dict(seed=2**63),
        dict(top_logprobs=20, logprobs=True),
        dict(stop=["\nUser:", ""], stop_token_ids=[0, 7]),
        dict(temperature=1),  # ints are fine where floats are expected
    ],
)
def test_valid(kwargs):
    SamplingParams(**kwargs).validate()


@pytest.mark.parametrize(
    "kwargs, field, fragment",
    [
        (dict(temperature=-0.1), "temperature", "between 0 and 100"),
        (dict(temperature=1000.0), "temperature", "got 1000"),
        (dict(temperature=math.nan), "temperature", "temperature"),
        (dict(temperature=math.inf), "temperature", "temperature"),
        (dict(temperature="hot"), "temperature", "must be a number"),
        (dict(top_p=1.5), "top_p", "between 0 and 1, got 1.5"),
        (dict(top_p=-0.1), "top_p", "top_p"),
        (dict(min_p=2.0), "min_p", "between 0 and 1"),
        (dict(typical_p=-1.0), "typical_p", "between 0 and 1"),
        (dict(top_k=-1), "top_k", "at least 0, got -1"),
        (dict(top_k=2.5), "top_k", "must be an integer"),
        (dict(max_tokens=0), "max_tokens", "at least 1, got 0"),
        (dict(min_tokens=-1), "min_tokens", "at least 0"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens", "at most max_tokens"),
        (dict(repeat_penalty=0.0), "repeat_penalty", "greater than 0"),
        (dict(repeat_penalty=1e39), "repeat_penalty", "at most 3.40282e+38"),  # inf in the sampler's fp32
        (dict(repeat_last_n=-2), "repeat_last_n", "at least -1"),
        (dict(presence_penalty=2.5), "presence_penalty", "between -2 and 2"),
        (dict(frequency_penalty=-3.0), "frequency_penalty", "between -2 and 2"),
        (dict(top_logprobs=21), "top_logprobs", "between 0 and 20, got 21"),
        (dict(seed=1.5), "seed", "integer"),
        (dict(stop="STOP"), "stop", "list of strings"),
        (dict(stop=[1]), "stop", "list of strings"),
        (dict(stop_token_ids=[-1]), "stop_token_ids", "at least 0"),
        (dict(top_k=True), "top_k", "integer"),
    ],
)
def test_invalid_names_field_and_range(kwargs, field, fragment):
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(**kwargs).validate()
    assert err.value.field == field
    assert field in str(err.value)
    assert fragment in str(err.value)
    assert isinstance(err.value, ValueError)


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy


def test_uses_penalties():
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repeat_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=0.5).uses_penalties
    assert not SamplingParams(repeat_penalty=1.1, repeat_last_n=0).uses_penalties
