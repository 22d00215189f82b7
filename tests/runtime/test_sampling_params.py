"""SamplingParams defaults, derived values and validation messages."""

import pytest

from kiln.errors import KilnError
from kiln.runtime.sampling_params import MAX_LOGPROBS, InvalidSamplingParams, SamplingParams


def test_defaults_are_valid_and_openai_like():
    p = SamplingParams().validate()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.n) == (16, 1.0, 1.0, -1, 1)
    assert not p.is_greedy and not p.uses_penalties and p.stop_strings == ()


def test_derived_values():
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(top_k=1).is_greedy
    assert SamplingParams(stop="x").stop_strings == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop_strings == ("a", "b")
    assert SamplingParams(presence_penalty=0.5).uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert not SamplingParams(top_k=0).top_k_enabled and SamplingParams(top_k=5).top_k_enabled


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("max_tokens", 0, "integer >= 1"),
        ("max_tokens", 2.5, "integer >= 1"),
        ("min_tokens", 20, "[0, max_tokens=16]"),
        ("min_tokens", -1, "[0, max_tokens=16]"),
        ("temperature", -0.1, ">= 0"),
        ("temperature", float("nan"), ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_k", -2, "-1 or 0 (off)"),
        ("min_p", 1.2, "[0, 1]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("frequency_penalty", 2.5, "[-2, 2]"),
        ("presence_penalty", -3, "[-2, 2]"),
        ("seed", 1.5, "integer or null"),
        ("stop", ["ok", ""], "non-empty"),
        ("stop", 5, "list of strings"),
        ("stop_token_ids", [1, -2], "integers >= 0"),
        ("stop_token_ids", 3, "list of token ids"),
        ("logprobs", MAX_LOGPROBS + 1, f"[0, {MAX_LOGPROBS}]"),
        ("logprobs", True, "integer"),
        ("ignore_eos", 1, "true or false"),
        ("n", 0, "integer >= 1"),
        ("speculative", "no", "true, false or null"),
        ("speculative", 1, "true, false or null"),
    ],
)
def test_invalid_values_name_param_and_range(field, value, needle):
    p = SamplingParams(**{field: value})
    with pytest.raises(InvalidSamplingParams) as ei:
        p.validate()
    err = ei.value
    assert err.param == field and needle in str(err) and str(err).startswith(f"{field}:")
    assert isinstance(err, KilnError) and isinstance(err, ValueError)


def test_max_model_len_caps_max_tokens():
    SamplingParams(max_tokens=100).validate(max_model_len=100)
    with pytest.raises(InvalidSamplingParams, match="at most 100"):
        SamplingParams(max_tokens=101).validate(max_model_len=100)


def test_edge_values_pass():
    SamplingParams(
        temperature=0,
        top_p=1e-6,
        top_k=0,
        min_p=1.0,
        frequency_penalty=-2,
        presence_penalty=2,
        seed=-5,
        logprobs=0,
        stop=[],
        stop_token_ids=[0],
        min_tokens=16,
    ).validate()
