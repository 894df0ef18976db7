"""The overlap scheduler (launch step N+1 before finishing step N) against the plain one on
stories260K (float32, CPU, where overlap is forced on): same tokens, text, finish reasons,
logprobs and stream deltas for every kind of request, including early stops, penalties (which
drain), prompt logprobs (not deferred), aborts, pauses and KV-shortage retraction."""

import pytest
import torch

from engine.engine import Engine, _merge
from engine.io_struct import AbortReq, GenerateReqInput
from engine.scheduler.launched import resolve_placeholders
from engine.types import SamplingParams
from tests.conftest import STORIES

PROMPTS = ["Once upon a time", "Lily went to the park", "The dog", "Tom had a red ball and",
           "One day, a little bird", "She was sad", "The sun was", "A big cat saw a mouse and",
           "Ben and Mia", "There was a", "He liked to", "The tree was very tall and"]
G = {"temperature": 0, "max_new_tokens": 24}
# (sampling params, return_logprob, top_logprobs_num, logprob_start_len, stream) per prompt
MIXED = [
    (G, False, 0, -1, False),
    ({**G, "stop_token_ids": [426]}, False, 0, -1, True),  # "." ends it mid-batch
    ({**G, "stop": "ball."}, False, 0, -1, True),
    ({"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 20, "sampling_seed": 5}, True, 3,
     -1, False),
    ({**G, "max_new_tokens": 1}, False, 0, -1, False),
    ({**G, "max_new_tokens": 20, "stop_token_ids": [426], "min_new_tokens": 9}, False, 0, -1,
     True),
    ({"temperature": 1.0, "top_k": 20, "max_new_tokens": 16, "sampling_seed": 9}, False, 0, -1,
     True),
    ({**G, "max_new_tokens": 12}, True, 2, 0, False),  # prompt logprobs: never deferred
    (G, True, 0, -1, True),
    ({**G, "stop": [" was", "xyz"]}, False, 0, -1, False),
    ({**G, "max_new_tokens": 0}, True, 0, 0, False),
    ({**G, "max_new_tokens": 30}, False, 0, -1, True),
]


def make(overlap: bool, **kw) -> Engine:
    eng = Engine(model_path=STORIES, random_seed=0, **kw)
    eng.scheduler.overlap = overlap
    return eng


def inputs(eng: Engine, specs, tag: str = "") -> list[GenerateReqInput]:
    return [GenerateReqInput(f"r{tag}{i}", eng.tokenizer.encode(p), SamplingParams.from_dict(sp),
                             lp, top, start, stream)
            for i, (p, (sp, lp, top, start, stream)) in enumerate(zip(PROMPTS, specs))]


def run(eng: Engine, reqs, between=None) -> tuple[dict, dict]:
    """Step until every request finished. Returns (merged results, stream deltas per rid);
    ``between(step_index, scheduler)`` runs after each step."""
    sched, res, deltas, k = eng.scheduler, {}, {}, 0
    for r in reqs:
        sched.add_request(r)
    while sched.busy:
        for out in sched.step():
            res[out.rid] = _merge(res.get(out.rid), out)
            deltas.setdefault(out.rid, []).append((out.new_output_ids, out.new_text))
        if between is not None:
            between(k, sched)
        k += 1
    return res, deltas


LP_KEYS = ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs",
           "input_top_logprobs")


def assert_same(got: dict, ref: dict) -> None:
    """Equal results; logprob values within 1e-4 (a row's float32 sums depend on which other
    rows share its batch, and an overlapped step may carry a request that just finished)."""
    assert got.keys() == ref.keys()
    for rid in ref:
        g, r = got[rid], ref[rid]
        assert (g["text"], g["output_ids"]) == (r["text"], r["output_ids"]), rid
        gm, rm = dict(g["meta_info"]), dict(r["meta_info"])
        for key in LP_KEYS:
            flat_g, flat_r = flatten(gm.pop(key, [])), flatten(rm.pop(key, []))
            assert [t for _, t in flat_g] == [t for _, t in flat_r], (rid, key)
            assert [v for v, _ in flat_g] == pytest.approx([v for v, _ in flat_r], abs=1e-4)
        assert gm == rm, rid


def flatten(entries: list) -> list:
    """(logprob, token) pairs of a logprob list, top-k lists unrolled; None -> 1.0."""
    out = []
    for e in entries:
        for v, t in (e if isinstance(e, list) else [e]):
            out.append((1.0 if v is None else v, t))
    return out


def test_resolve_placeholders_exact():
    ids = torch.tensor([5, -1, 7, -3, 0], dtype=torch.int64)
    resolve_placeholders(ids, torch.tensor([10, 11, 12], dtype=torch.int64))
    assert ids.tolist() == [5, 10, 7, 12, 0]


def test_mixed_workload_same_with_and_without_overlap():
    ref_eng, ovl_eng = make(False), make(True)
    ref, ref_deltas = run(ref_eng, inputs(ref_eng, MIXED))
    seen = []
    got, got_deltas = run(ovl_eng, inputs(ovl_eng, MIXED),
                          lambda k, s: seen.append(s.inflight is not None))
    assert_same(got, ref)
    assert got_deltas == ref_deltas  # streamed pieces too, not only their sum
    assert sum(seen) >= 10  # steps really were left in flight
    assert ref["r1"]["meta_info"]["finish_reason"] == {"type": "stop", "matched": 426}
    assert ref["r2"]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "ball."}
    assert ref["r5"]["meta_info"]["finish_reason"] == {"type": "stop", "matched": 426}
    assert len(ref["r7"]["meta_info"]["input_token_logprobs"]) == len(
        ovl_eng.tokenizer.encode(PROMPTS[7]))
    for eng in (ref_eng, ovl_eng):
        assert eng.scheduler.get_internal_state()["kv_used_tokens"] == 0
        assert eng.scheduler.inflight is None and not eng.scheduler.busy


def test_in_flight_step_holds_placeholders_that_the_next_step_resolves():
    eng = make(True)
    sched = eng.scheduler
    sched.add_request(GenerateReqInput("a", eng.tokenizer.encode("The dog"),
                                       SamplingParams.from_dict(G)))
    sched.step()  # prefill: its token stays in flight
    (req,) = sched.running
    assert sched.inflight is not None and req.output_ids == [-1]
    outs = sched.step()  # decode launched on the placeholder, then the prefill finished
    assert req.output_ids[0] > 0 and req.output_ids[1] == -1 and outs == []
    ref = make(False).generate("The dog", G)["output_ids"]
    while sched.busy:
        sched.step()
    assert req.output_ids == ref


def test_penalties_drain_and_match():
    sp = {"temperature": 0, "max_new_tokens": 20, "repetition_penalty": 1.5,
          "frequency_penalty": 0.5}
    specs = [(sp, False, 0, -1, False), (G, False, 0, -1, False)] * 2
    ref, _ = run(make(False), inputs(make(False), specs))
    eng = make(True)
    seen = []
    got, _ = run(eng, inputs(eng, specs), lambda k, s: seen.append(
        (s.inflight is not None, any(r.sampling_params.repetition_penalty != 1
                                     for r in s.running))))
    assert_same(got, ref)
    # no step is left in flight while a penalised request runs (its sampling reads tokens);
    # the greedy ones, 4 tokens longer, overlap once the penalised ones are done
    assert not any(inflight for inflight, penalised in seen if penalised)
    assert sum(inflight for inflight, _ in seen) >= 3


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_pause_and_abort_with_a_step_in_flight_match_plain(mode):
    specs = [(G, False, 0, -1, True)] * 4

    def poke(k, s):
        if k == 5:
            s.abort(AbortReq(rid="r1"))
        if k == 8:
            assert s.pause_generation(mode)[0]
        if k == 10:
            s.continue_generation()

    results = []
    for overlap in (False, True):
        eng = make(overlap)
        results.append(run(eng, inputs(eng, specs), poke))
        assert eng.scheduler.get_internal_state()["kv_used_tokens"] == 0
    assert_same(results[1][0], results[0][0])
    assert results[1][1] == results[0][1]
    res = results[0][0]
    assert res["r1"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(res["r1"]["output_ids"]) == 6
    if mode == "abort":
        assert all(res[f"r{i}"]["meta_info"]["finish_reason"]["type"] == "abort"
                   for i in range(4))


def test_kv_shortage_and_chunked_prefill_with_overlap_match_plain():
    specs = [(G, False, 0, -1, False)] * len(PROMPTS)
    for kw in ({"max_total_tokens": 96, "page_size": 4}, {"chunked_prefill_size": 8}):
        ref, _ = run(make(False, **kw), inputs(make(False, **kw), specs))
        eng = make(True, **kw)
        got, _ = run(eng, inputs(eng, specs))
        assert_same(got, ref)
        second, _ = run(eng, inputs(eng, specs, tag="b"))  # prefix-cache hits this time
        assert [second[f"rb{i}"]["output_ids"] for i in range(len(PROMPTS))] == \
            [ref[f"r{i}"]["output_ids"] for i in range(len(PROMPTS))]
        if "max_total_tokens" in kw:
            assert sum(r["meta_info"]["total_retractions"] for r in got.values()) > 0


def test_engine_is_idle_once_the_last_answer_is_out():
    # the request ends on a stop token: the step launched beside its last one is void
    eng = make(True)
    out = eng.generate("Once upon a time", {**G, "stop_token_ids": [426]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 426}
    assert not eng.scheduler.busy and eng.scheduler.inflight is None
    assert eng.scheduler.flush_cache() == (True, "Cache flushed.")


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_short_of_kv_retracts_a_partial_prefill_rather_than_aborting(overlap):
    # A (10 + 30 tokens) fits the 64-slot pool; B's memory-limited first chunk takes the last
    # free slots, so A's next decode slot must come from retracting B, not from aborting A
    eng = make(overlap, max_total_tokens=64)
    sp = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 30, "ignore_eos": True})
    reqs = [GenerateReqInput("A", list(range(10, 20)), sp)]
    late = GenerateReqInput("B", list(range(100, 150)), SamplingParams.from_dict(
        {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}))
    res, _ = run(eng, reqs, lambda k, s: s.add_request(late) if k == 3 else None)
    assert res["A"]["meta_info"]["finish_reason"] == {"type": "length", "length": 30}
    assert res["B"]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert res["B"]["meta_info"]["total_retractions"] >= 1


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_of_a_retracted_chunked_prefill_are_reported_once(overlap):
    eng = make(overlap, chunked_prefill_size=8)
    prompt = list(range(100, 125))
    req = GenerateReqInput("A", prompt, SamplingParams.from_dict(
        {"temperature": 0, "max_new_tokens": 3}), return_logprob=True, logprob_start_len=0)

    def retract_mid_prefill(k, s):
        if k == 1:
            s.pause_generation("retract")
            s.continue_generation()

    res, _ = run(eng, [req], retract_mid_prefill)
    lps = res["A"]["meta_info"]["input_token_logprobs"]
    assert [t for _, t in lps] == prompt and lps[0][0] is None
    assert res["A"]["meta_info"]["total_retractions"] == 1
