import pytest

from widellm.sampling_params import SAMPLING_EPS, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (
        16, 0, None, None, None
    )
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.ignore_eos, p.skip_special_tokens, p.include_stop_str_in_output, p.detokenize) == (
        False, True, False, True
    )


def test_is_slotted():
    p = SamplingParams()
    assert not hasattr(p, "__dict__")
    with pytest.raises(AttributeError):
        p.not_a_field = 1


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=None, top_k=-1)
    assert p.stop == ["###"]
    assert p.stop_token_ids == []
    assert p.top_k == 0
    q = SamplingParams(stop=("a", "b"), stop_token_ids=(5, 7))
    assert q.stop == ["a", "b"] and q.stop_token_ids == [5, 7]


def test_greedy_clears_filters():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be >= 0 (0 or -1 disables it), got -2"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"presence_penalty": -2.5}, "presence_penalty must be in [-2, 2], got -2.5"),
        ({"frequency_penalty": 3.0}, "frequency_penalty must be in [-2, 2], got 3.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 6, "max_tokens": 5}, "min_tokens must be <= max_tokens=5, got 6"),
        ({"logprobs": -1}, "logprobs must be >= 0, got -1"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be >= 0, got -1"),
        ({"seed": "7"}, "seed must be an int or None, got '7'"),
        ({"seed": True}, "seed must be an int or None, got True"),
        ({"stop": ["ok", ""]}, "stop must contain only non-empty strings, got ['ok', '']"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids must be >= 0, got [3, -1]"),
        ({"allowed_token_ids": []},
         "allowed_token_ids must be a non-empty list of token ids >= 0, got []"),
        ({"allowed_token_ids": [4, -1]},
         "allowed_token_ids must be a non-empty list of token ids >= 0, got [4, -1]"),
    ],
)
def test_validation_names_parameter(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert str(excinfo.value) == message


def test_valid_boundaries_accepted():
    p = SamplingParams(
        top_p=1.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
        repetition_penalty=0.5, max_tokens=None, min_tokens=100, logprobs=0,
        prompt_logprobs=0, seed=0,
    )
    assert p.min_tokens == 100 and p.max_tokens is None


def test_sampling_type():
    assert SamplingParams(temperature=0.0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=SAMPLING_EPS / 2, seed=3).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=SAMPLING_EPS).sampling_type is SamplingType.RANDOM
    assert SamplingParams(temperature=0.8, seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_all_stop_token_ids_and_clone():
    p = SamplingParams(stop_token_ids=[7, 3, 7])
    assert p.all_stop_token_ids == frozenset({3, 7})
    c = p.clone()
    c.stop_token_ids.append(9)
    assert p.stop_token_ids == [7, 3, 7]
    assert c.all_stop_token_ids == frozenset({3, 7, 9})
