"""Engine behaviour on stories260K (float32, CPU): batching invariance, prefix cache, KV
shortage, stop conditions, sampling controls and input validation."""

import pytest

from engine.engine import Engine
from engine.types import InvalidRequestError
from tests.conftest import STORIES, STORIES_GOLDEN

GREEDY = {"temperature": 0, "max_new_tokens": 57}
PROMPTS = ["Once upon a time", "Lily went to the park", "The dog", "Tom had a red ball and",
           "One day, a little bird", "She was sad", "The sun was", "A big cat saw a mouse and",
           "Ben and Mia", "There was a", "He liked to", "The tree was very tall and",
           "Mom said", "Once upon a time there was a boy", "In the sky", "It was a sunny day"]


@pytest.fixture(scope="module")
def engine():
    return Engine(model_path=STORIES)


@pytest.fixture(scope="module")
def alone(engine):
    """Greedy output of each prompt run on its own (the reference)."""
    return {p: engine.generate(p, {"temperature": 0, "max_new_tokens": 24})["output_ids"]
            for p in PROMPTS}


def test_golden_text_and_length_finish(engine):
    out = engine.generate("Once upon a time", GREEDY)
    assert out["text"] == STORIES_GOLDEN
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 57}
    assert out["meta_info"]["prompt_tokens"] == 5 and out["meta_info"]["completion_tokens"] == 57


def test_batch_with_chunked_prefill_and_prefix_cache_matches_alone(alone):
    eng = Engine(model_path=STORIES, chunked_prefill_size=16)
    sp = {"temperature": 0, "max_new_tokens": 24}
    first = eng.generate(PROMPTS, sp)
    assert [o["output_ids"] for o in first] == [alone[p] for p in PROMPTS]
    # second round: every prompt shares a prefix with a cached sequence
    second = eng.generate(PROMPTS, sp)
    assert [o["output_ids"] for o in second] == [alone[p] for p in PROMPTS]
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in second)
    assert eng.scheduler.get_internal_state()["kv_used_tokens"] == 0


def test_long_prompt_chunked_over_several_steps_matches_unchunked(engine):
    prompt = STORIES_GOLDEN * 2
    ref = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 16})["output_ids"]
    eng = Engine(model_path=STORIES, chunked_prefill_size=8, disable_radix_cache=True)
    assert eng.generate(prompt, {"temperature": 0, "max_new_tokens": 16})["output_ids"] == ref


def test_kv_shortage_retracts_and_every_request_finishes_right(alone):
    # 16 requests of ~5 + 24 tokens need ~450 slots; 96 slots force retraction and recompute
    eng = Engine(model_path=STORIES, max_total_tokens=96, page_size=4)
    outs = eng.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 24})
    assert [o["output_ids"] for o in outs] == [alone[p] for p in PROMPTS]
    assert sum(o["meta_info"]["total_retractions"] for o in outs) > 0


def test_disabled_radix_cache_reports_no_cached_tokens(alone):
    eng = Engine(model_path=STORIES, disable_radix_cache=True)
    for _ in range(2):
        out = eng.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 24})
        assert out["output_ids"] == alone[PROMPTS[0]]
        assert out["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize("extra, text, finish", [
    ({"stop": "Lily"}, ", there was a little girl named ", {"type": "stop", "matched": "Lily"}),
    # "le gi" spans the tokens "▁little" and "▁g"
    ({"stop": "le gi"}, ", there was a litt", {"type": "stop", "matched": "le gi"}),
    ({"stop": ["park", "girl"]}, ", there was a little ", {"type": "stop", "matched": "girl"}),
    ({"stop": ["park", "girl"], "no_stop_trim": True}, ", there was a little girl",
     {"type": "stop", "matched": "girl"}),
    ({"stop_token_ids": [426]}, ", there was a little girl named Lily",  # 426 = "."
     {"type": "stop", "matched": 426}),
    ({"max_new_tokens": 8}, ", there was a little girl", {"type": "length", "length": 8}),
])
def test_stop_conditions_exact(engine, extra, text, finish):
    out = engine.generate("Once upon a time", {**GREEDY, **extra})
    assert out["text"] == text
    assert out["meta_info"]["finish_reason"] == finish


def test_stop_token_id_kept_in_output_ids(engine):
    out = engine.generate("Once upon a time", {**GREEDY, "stop_token_ids": [426]})
    assert out["output_ids"][-1] == 426 and len(out["output_ids"]) == 11


def test_min_new_tokens_defers_stop(engine):
    out = engine.generate("Once upon a time", {**GREEDY, "stop_token_ids": [426],
                                               "min_new_tokens": 12})
    assert 426 not in out["output_ids"][:11]


def test_same_seed_same_tokens_and_top_k_1_is_greedy(engine):
    sp = {"temperature": 1.0, "max_new_tokens": 30, "sampling_seed": 1234}
    a = engine.generate("The dog", sp)["output_ids"]
    b = engine.generate(["She was sad", "The dog"], sp)[1]["output_ids"]
    assert a == b
    greedy = engine.generate("The dog", {"temperature": 0, "max_new_tokens": 30})["output_ids"]
    top1 = engine.generate("The dog", {"temperature": 0.8, "top_k": 1, "max_new_tokens": 30})
    assert top1["output_ids"] == greedy


def test_logit_bias_minus_100_never_sampled(engine):
    banned = 383  # "▁there", the greedy second token after "Once upon a time,"
    outs = engine.generate(["Once upon a time,"] * 10,
                           {"temperature": 1.0, "max_new_tokens": 20, "ignore_eos": True,
                            "logit_bias": {str(banned): -100.0}})
    tokens = [t for o in outs for t in o["output_ids"]]
    assert len(tokens) == 200 and banned not in tokens


def test_n_greater_than_one_returns_n_sequences(engine):
    outs = engine.generate("The dog", {"temperature": 1.0, "max_new_tokens": 8, "n": 3,
                                       "sampling_seed": 7})
    assert len(outs) == 3 and all(len(o["output_ids"]) == 8 for o in outs)


@pytest.mark.parametrize("kwargs, field", [
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1] * 600}, "input_ids"),
    ({"input_ids": [1, 5000]}, "input_ids"),
    ({"sp": {"temperature": -0.5}}, "sampling_params.temperature"),
    ({"sp": {"top_p": 0.0}}, "sampling_params.top_p"),
    ({"sp": {"top_p": 1.5}}, "sampling_params.top_p"),
    ({"sp": {"top_k": 0}}, "sampling_params.top_k"),
    ({"sp": {"top_k": -2}}, "sampling_params.top_k"),
    ({"sp": {"min_p": 1.5}}, "sampling_params.min_p"),
    ({"sp": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"sp": {"n": 0}}, "sampling_params.n"),
    ({"sp": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"sp": {"bogus": 1}}, "sampling_params.bogus"),
])
def test_bad_input_names_the_field_and_engine_keeps_serving(engine, kwargs, field):
    ids = kwargs.get("input_ids", [1, 400, 300])
    with pytest.raises(InvalidRequestError) as err:
        engine.generate(input_ids=ids, sampling_params=kwargs.get("sp", {"max_new_tokens": 4}))
    assert err.value.field == field and str(err.value).startswith(field)
    out = engine.generate("Once upon a time", {**GREEDY, "max_new_tokens": 8})
    assert out["text"] == ", there was a little girl"


def test_prompt_and_output_logprobs(engine):
    out = engine.generate("Once upon a time", {"temperature": 0, "max_new_tokens": 3},
                          return_logprob=True, top_logprobs_num=2, logprob_start_len=0)
    m = out["meta_info"]
    assert len(m["input_token_logprobs"]) == 5 and m["input_token_logprobs"][0][0] is None
    assert [t for _, t in m["output_token_logprobs"]] == out["output_ids"]
    # greedy: each chosen token is the top-1 alternative
    assert [top[0][1] for top in m["output_top_logprobs"]] == out["output_ids"]


def test_one_token_prompt_reports_its_none_prompt_logprob(engine):
    out = engine.generate(input_ids=[300], sampling_params={"temperature": 0, "max_new_tokens": 2},
                          return_logprob=True, logprob_start_len=0)
    assert out["meta_info"]["input_token_logprobs"] == [(None, 300)]
    assert out["meta_info"]["input_top_logprobs"] == [[]]


def test_stop_prefix_len():
    from engine.tokenizer import stop_prefix_len
    assert stop_prefix_len(", there was a little gir", [" girl"]) == 4
    assert stop_prefix_len("abc", ["xyz", "cd"]) == 1
    assert stop_prefix_len("abc", []) == 0
    assert stop_prefix_len("a", ["a"]) == 0  # a whole stop string is trimmed, not held


def test_stream_never_shows_a_stop_prefix_that_is_later_trimmed(engine):
    import asyncio

    async def collect():
        deltas = []
        async for out in engine.async_generate("Once upon a time",
                                               {**GREEDY, "stop": " girl named"}):
            deltas.append(out.new_text)
        return deltas

    deltas = asyncio.run(collect())
    assert "".join(deltas) == ", there was a little"
    # " girl" was held back while it could still become the stop string
    assert all("gir" not in d for d in deltas)


@pytest.mark.parametrize("sp, field", [
    ({"temperature": float("nan")}, "sampling_params.temperature"),
    ({"temperature": float("inf")}, "sampling_params.temperature"),
    ({"repetition_penalty": 0.0}, "sampling_params.repetition_penalty"),
])
def test_non_finite_or_degenerate_sampling_values_are_rejected(engine, sp, field):
    with pytest.raises(InvalidRequestError) as err:
        engine.generate("The dog", {"max_new_tokens": 4, **sp})
    assert err.value.field == field


def test_seeded_n_samples_differ_but_repeat_as_a_set(engine):
    sp = {"temperature": 1.0, "max_new_tokens": 12, "n": 3, "sampling_seed": 42}
    first = [o["output_ids"] for o in engine.generate("The dog", sp)]
    assert len({tuple(x) for x in first}) == 3
    assert [o["output_ids"] for o in engine.generate("The dog", sp)] == first
    # sample 0 of the set is the plain seeded request
    single = engine.generate("The dog", {**sp, "n": 1})["output_ids"]
    assert first[0] == single
