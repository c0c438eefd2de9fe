import pytest

from fp8serve.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams, check_max_logprobs, truncate_prompt


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens) == (None, 16, 0)
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.ignore_eos, p.logprobs, p.prompt_logprobs) == (False, None, None)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.skip_special_tokens and not p.include_stop_str_in_output and p.detokenize
    assert not p.is_greedy and not p.has_penalties


def test_normalization():
    p = SamplingParams(top_k=-1, stop="###", stop_token_ids=(5, 7))
    assert p.top_k == 0
    assert p.stop == ["###"]
    assert p.stop_token_ids == [5, 7]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_greedy_forces_filters_off():
    p = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.0, 1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(n=129), "n"),
        (dict(n=1.5), "n"),
        (dict(n=True), "n"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(seed=1.5), "seed"),
        (dict(seed="7"), "seed"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=1.5), "logprobs"),
        (dict(prompt_logprobs=True), "prompt_logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop=""), "stop"),
        (dict(stop_token_ids=[-3]), "stop_token_ids"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={True: 1.0}), "logit_bias"),
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(logit_bias={5: 100.5}), "logit_bias"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(logit_bias={5: "1"}), "logit_bias"),
        (dict(logit_bias={5: True}), "logit_bias"),
        (dict(logit_bias=[(5, 1.0)]), "logit_bias"),
        # Types: caught here, not as a TypeError inside a step (which takes the whole batch).
        (dict(temperature="0.5"), "temperature"),
        (dict(temperature=None), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(top_p="1"), "top_p"),
        (dict(repetition_penalty=None), "repetition_penalty"),
        (dict(skip_special_tokens=None), "skip_special_tokens"),
        (dict(ignore_eos="no"), "ignore_eos"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
        (dict(detokenize=0), "detokenize"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=2.0), "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=True), "truncate_prompt_tokens"),
        (dict(detokenize=False, stop=["###"]), "stop"),
        (dict(stop=5), "stop"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(stop_token_ids="12"), "stop_token_ids"),
        (dict(seed=2**64), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
    ],
)
def test_validation_error_names_field_and_value(kwargs, field):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    message = str(excinfo.value)
    assert message.startswith(field + " ")
    assert excinfo.value.parameter == field  # the server's OpenAI error `param`
    bad = kwargs[field] if field in kwargs else None
    if field not in ("stop", "stop_token_ids", "logit_bias"):
        assert repr(bad) in message or str(bad) in message


def test_n_up_to_openais_limit():
    assert SamplingParams(n=3).n == 3 and SamplingParams(n=MAX_N).n == MAX_N == 128
    with pytest.raises(ValueError, match=r"n must be an int in \[1, 128\], got 129"):
        SamplingParams(n=129)


def test_boundaries_accepted():
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
                   logprobs=0, prompt_logprobs=MAX_LOGPROBS, max_tokens=None, min_tokens=100, seed=0)
    SamplingParams(min_tokens=5, max_tokens=5)


def test_logit_bias_kept_and_empty_means_none():
    assert SamplingParams(logit_bias={5: -100, 7: 2.5}).logit_bias == {5: -100, 7: 2.5}
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams().logit_bias is None


def test_validate_checks_fields_changed_after_construction():
    """The engine runs validate() again when a request is added."""
    p = SamplingParams(max_tokens=4)
    p.n = 0
    with pytest.raises(ValueError, match="n must be an int"):
        p.validate()
    p = SamplingParams()
    p.logprobs = -3
    with pytest.raises(ValueError, match="logprobs must be a non-negative int"):
        p.validate()
    p = SamplingParams()
    p.stop = "###"
    p.validate()
    assert p.stop == ["###"]


def test_logprobs_bound_is_the_engines():
    """As vLLM: any non-negative count constructs; the engine's max_logprobs (--max-logprobs,
    default 20) bounds it when the request is added."""
    p = SamplingParams(logprobs=MAX_LOGPROBS + 5, prompt_logprobs=3)
    check_max_logprobs(p, MAX_LOGPROBS + 5)
    with pytest.raises(ValueError, match=r"^logprobs: requested 25 per position, more than max_logprobs 20") as e:
        check_max_logprobs(p, MAX_LOGPROBS)
    assert e.value.parameter == "logprobs"
    with pytest.raises(ValueError, match=r"^prompt_logprobs: requested 3 per position, more than max_logprobs 2 ") \
            as e:
        check_max_logprobs(SamplingParams(prompt_logprobs=3), 2)
    assert e.value.parameter == "prompt_logprobs"
    check_max_logprobs(SamplingParams(), 0)


def test_truncate_prompt_keeps_the_last_tokens():
    ids = list(range(100, 130))
    assert truncate_prompt(ids, None, 64) == ids
    assert truncate_prompt(ids, 5, 64) == ids[-5:]
    assert truncate_prompt(ids, 30, 64) == ids and truncate_prompt(ids, 40, 64) == ids
    assert truncate_prompt(ids, -1, 8) == ids[-8:]  # -1: max_model_len
    with pytest.raises(ValueError, match="truncate_prompt_tokens 65 is more than max_model_len 64") as e:
        truncate_prompt(ids, 65, 64)
    assert e.value.parameter == "truncate_prompt_tokens"
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be an int >= 1, or -1"):
            truncate_prompt(ids, bad, 64)
