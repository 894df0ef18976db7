"""Sampler semantics on crafted rows with hand-computed expectations (CPU, and CUDA if present)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.runner.sampler import (Sampler, SamplingBatchInfo, apply_penalties_and_bias,
                                   apply_top_k_top_p_min_p, compute_prompt_logprobs,
                                   greedy_next_ids, plain_greedy)
from engine.types import Req, SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# vocab order of a crafted distribution: sorted it is 0.5, 0.2, 0.15, 0.1, 0.05
PROBS = [0.1, 0.5, 0.05, 0.2, 0.15]


def make_req(prompt=(1, 2), output=(), **sp) -> Req:
    return Req(rid="r", origin_input_ids=list(prompt), sampling_params=SamplingParams(**sp),
               output_ids=list(output))


def filt(top_k=-1, top_p=1.0, min_p=0.0, device="cpu"):
    probs = torch.tensor([PROBS], device=device)
    return apply_top_k_top_p_min_p(
        probs, torch.tensor([top_k if top_k > 0 else 5], device=device),
        torch.tensor([top_p], device=device), torch.tensor([min_p], device=device)).cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_mask_keeps_prefix_whose_preceding_mass_is_within_top_p(device):
    # preceding mass of sorted tokens: 0, .5, .7, .85, .95 -> top_p=.75 keeps .5, .2, .15
    expected = torch.tensor([[0.0, 0.5 / 0.85, 0.0, 0.2 / 0.85, 0.15 / 0.85]])
    torch.testing.assert_close(filt(top_p=0.75, device=device), expected)
    # the top token always survives, however small top_p is
    torch.testing.assert_close(filt(top_p=0.01, device=device),
                               torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_mask_drops_tokens_below_min_p_times_max(device):
    # threshold .35 * .5 = .175 keeps .5 and .2
    expected = torch.tensor([[0.0, 0.5 / 0.7, 0.0, 0.2 / 0.7, 0.0]])
    torch.testing.assert_close(filt(min_p=0.35, device=device), expected)


def test_top_k_mask_then_top_p_on_renormalised_probs():
    torch.testing.assert_close(filt(top_k=2), torch.tensor([[0.0, 0.5 / 0.7, 0.0, 0.2 / 0.7, 0.0]]))
    # after top_k=3 the renormalised preceding masses are 0, .588, .824 -> top_p=.8 keeps two
    torch.testing.assert_close(filt(top_k=3, top_p=0.8),
                               torch.tensor([[0.0, 0.5 / 0.7, 0.0, 0.2 / 0.7, 0.0]]))


def test_no_filter_is_identity():
    torch.testing.assert_close(filt(), torch.tensor([PROBS]))


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_1_and_temperature_0_equal_greedy_argmax(device):
    torch.manual_seed(0)
    logits = torch.randn(6, 100, device=device)
    reqs = [make_req(top_k=1), make_req(temperature=0.0), make_req(top_k=1, temperature=0.5),
            make_req(temperature=1e-7), make_req(top_k=1, top_p=0.3), make_req(top_k=1, min_p=.9)]
    info = SamplingBatchInfo.from_reqs(reqs, 100, torch.device(device))
    assert info.is_all_greedy
    out = Sampler(seed=1)(logits, info, reqs, return_logprob=False, top_logprobs_num=0)
    assert out.next_token_ids.dtype == torch.int64
    assert out.next_token_ids.tolist() == logits.argmax(-1).tolist()
    # a greedy row mixed into a sampled batch still takes the argmax
    reqs2 = [make_req(top_k=1), make_req(temperature=1.0)]
    info2 = SamplingBatchInfo.from_reqs(reqs2, 100, torch.device(device))
    assert not info2.is_all_greedy
    out2 = Sampler(seed=1)(logits[:2], info2, reqs2, False, 0)
    assert out2.next_token_ids[0].item() == logits[0].argmax().item()


@pytest.mark.parametrize("device", DEVICES)
def test_plain_greedy_fast_path_equals_full_sampler(device):
    torch.manual_seed(0)
    logits = torch.randn(5, 300, device=device)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the lower id wins on both paths
    reqs = [make_req(top_k=1), make_req(temperature=0.0), make_req(temperature=0.0, top_p=.5),
            make_req(temperature=0.0, min_new_tokens=3, ignore_eos=True),
            make_req(temperature=0.0, stop_token_ids=[5], output=(1, 2, 3), min_new_tokens=2)]
    assert plain_greedy(reqs, eos_token_ids=(2,))
    info = SamplingBatchInfo.from_reqs(reqs, 300, torch.device(device), eos_token_ids=(2,))
    full = Sampler(seed=0)(logits, info, reqs, False, 0).next_token_ids.tolist()
    assert greedy_next_ids(logits).tolist() == full
    assert full[2] == 7


def test_plain_greedy_rejects_rows_that_need_the_full_sampler():
    eos = (2,)
    for sp in (dict(temperature=0.7), dict(temperature=0.0, repetition_penalty=1.1),
               dict(temperature=0.0, frequency_penalty=0.5),
               dict(temperature=0.0, presence_penalty=-0.5),
               dict(temperature=0.0, logit_bias={"3": 2.0}),
               dict(temperature=0.0, min_new_tokens=2),  # EOS banned below min_new_tokens
               dict(temperature=0.0, min_new_tokens=2, ignore_eos=True, stop_token_ids=[4])):
        assert not plain_greedy([make_req(top_k=1), make_req(**sp)], eos), sp
    lp = make_req(temperature=0.0)
    lp.return_logprob = True
    assert not plain_greedy([lp], eos)
    # the EOS ban only matters when the model has EOS ids
    assert plain_greedy([make_req(temperature=0.0, min_new_tokens=2)], ())


def _generate(sampler, logits_fn, seeded, others, steps, device):
    """Run ``steps`` sampling steps; ``seeded`` sits at batch row ``len(others)``."""
    batch = others + [seeded]
    tokens = []
    for step in range(steps):
        logits = torch.stack([logits_fn(step, i) for i in range(len(batch))]).to(device)
        logits[-1] = logits_fn(step, -1)  # the seeded row's logits do not depend on its row
        info = SamplingBatchInfo.from_reqs(batch, logits.shape[1], torch.device(device))
        ids = sampler(logits, info, batch, False, 0).next_token_ids.tolist()
        for r, t in zip(batch, ids):
            r.output_ids.append(t)
        tokens.append(ids[-1])
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_same_sampling_seed_gives_same_tokens_regardless_of_batch(device):
    def logits_fn(step, row):
        g = torch.Generator().manual_seed(1000 * step + row + 7)
        return torch.randn(64, generator=g) * 0.5

    def run(others, sampler_seed):
        seeded = make_req(sampling_seed=1234, temperature=1.0, top_p=0.95)
        return _generate(Sampler(seed=sampler_seed), logits_fn, seeded, others, 20, device)

    alone = run([], 0)
    crowded = run([make_req(temperature=0.8), make_req(sampling_seed=99), make_req(top_k=1)], 5)
    assert alone == crowded
    assert len(set(alone)) > 3  # really sampled, not argmax every step
    other = _generate(Sampler(seed=0), logits_fn,
                      make_req(sampling_seed=4321, temperature=1.0, top_p=0.95), [], 20, device)
    assert other != alone


def test_sampler_seed_makes_unseeded_rows_reproducible():
    logits = torch.zeros(8, 50)
    reqs = [make_req() for _ in range(8)]
    info = SamplingBatchInfo.from_reqs(reqs, 50, torch.device("cpu"))
    a = Sampler(seed=3)(logits, info, reqs, False, 0).next_token_ids
    b = Sampler(seed=3)(logits, info, reqs, False, 0).next_token_ids
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_minus_100_token_never_sampled(device):
    V = 10
    reqs = [make_req(temperature=1.0, logit_bias={"3": -100.0}) for _ in range(200)]
    info = SamplingBatchInfo.from_reqs(reqs, V, torch.device(device))
    out = Sampler(seed=0)(torch.zeros(200, V, device=device), info, reqs, False, 0)
    ids = out.next_token_ids.tolist()
    assert 3 not in ids
    assert len(set(ids)) == V - 1  # all others appear: the draw is really uniform over them
    # a +100 bias wins every draw
    reqs = [make_req(temperature=1.0, logit_bias={"7": 100.0}) for _ in range(20)]
    info = SamplingBatchInfo.from_reqs(reqs, V, torch.device(device))
    out = Sampler(seed=0)(torch.zeros(20, V, device=device), info, reqs, False, 0)
    assert out.next_token_ids.tolist() == [7] * 20


ROW = [2.0, -1.0, 0.5, 3.0, -2.0]


def penalised(device="cpu", **sp):
    # prompt [1], output [0, 0, 2]: token 0 generated twice, token 2 once, token 1 only in prompt
    req = make_req(prompt=[1], output=[0, 0, 2], **sp)
    info = SamplingBatchInfo.from_reqs([req], 5, torch.device(device))
    return apply_penalties_and_bias(torch.tensor([ROW], device=device), info)[0].tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_frequency_presence_repetition_penalties_give_hand_computed_logits(device):
    assert penalised(device, frequency_penalty=0.5) == [1.0, -1.0, 0.0, 3.0, -2.0]
    assert penalised(device, presence_penalty=0.25) == [1.75, -1.0, 0.25, 3.0, -2.0]
    # repetition covers prompt + output: positive logits divided, negative multiplied
    assert penalised(device, repetition_penalty=2.0) == [1.0, -2.0, 0.25, 3.0, -2.0]
    # repetition first, then frequency (count) and presence (once)
    assert penalised(device, repetition_penalty=2.0, frequency_penalty=0.5,
                     presence_penalty=0.25) == [-0.25, -2.0, -0.5, 3.0, -2.0]
    assert penalised(device) == ROW  # no penalties: untouched


def test_penalties_do_not_modify_input_logits():
    req = make_req(output=[0], frequency_penalty=1.0, logit_bias={"1": 5.0})
    info = SamplingBatchInfo.from_reqs([req], 5, torch.device("cpu"))
    logits = torch.tensor([ROW])
    apply_penalties_and_bias(logits, info)
    assert logits[0].tolist() == ROW


def test_min_new_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 4.0]])  # argmax is EOS (3), then stop id 4

    def pick(output, **sp):
        req = make_req(output=output, temperature=0.0, **sp)
        info = SamplingBatchInfo.from_reqs([req], 5, torch.device("cpu"), eos_token_ids=(3,))
        return Sampler(seed=0)(logits, info, [req], False, 0).next_token_ids.item()

    assert pick([9], min_new_tokens=2) == 4  # EOS banned
    assert pick([9], min_new_tokens=2, stop_token_ids=[4]) == 2  # stop id banned too
    assert pick([9, 9], min_new_tokens=2, stop_token_ids=[4]) == 3  # reached min: allowed
    assert pick([9], min_new_tokens=2, ignore_eos=True) == 3  # EOS cannot end it: not banned
    assert pick([], min_new_tokens=0) == 3


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_log_softmax_of_raw_logits(device):
    torch.manual_seed(1)
    logits = torch.randn(3, 40, device=device)
    reqs = [make_req(temperature=0.7, output=[5, 5], frequency_penalty=1.5, top_k=10),
            make_req(temperature=0.0, logit_bias={"2": 50.0}),
            make_req(temperature=1.3, repetition_penalty=1.8, min_p=0.05)]
    info = SamplingBatchInfo.from_reqs(reqs, 40, torch.device(device))
    out = Sampler(seed=0)(logits, info, reqs, return_logprob=True, top_logprobs_num=4)
    raw = torch.log_softmax(logits, dim=-1)
    ids = out.next_token_ids
    assert ids[1].item() == 2
    torch.testing.assert_close(out.logprobs, raw.gather(1, ids.unsqueeze(1)).squeeze(1))
    vals, idx = raw.topk(4, dim=-1)
    torch.testing.assert_close(out.top_logprobs_val, vals)
    assert out.top_logprobs_idx.tolist() == idx.tolist()
    plain = Sampler(seed=0)(logits, info, reqs, return_logprob=False, top_logprobs_num=0)
    assert plain.logprobs is None and plain.top_logprobs_val is None


def test_compute_prompt_logprobs_matches_log_softmax():
    logits = torch.tensor([[0.0, 0.0, math.log(2.0)], [1.0, 2.0, 3.0]])
    token_lp, top = compute_prompt_logprobs(logits, torch.tensor([2, 0]), top_logprobs_num=2)
    assert token_lp == pytest.approx([math.log(0.5), 1.0 - math.log(math.e + math.e**2 + math.e**3)])
    assert [t for _, t in top[0]] == [2, 0] and top[0][0][0] == pytest.approx(math.log(0.5))
    assert [t for _, t in top[1]] == [2, 1]
    _, none = compute_prompt_logprobs(logits, torch.tensor([2, 0]), top_logprobs_num=0)
    assert none == [[], []]


def test_batch_info_clamps_top_k_and_skips_unneeded_tensors():
    reqs = [make_req(top_k=-1), make_req(top_k=1000)]
    info = SamplingBatchInfo.from_reqs(reqs, 32, torch.device("cpu"))
    assert info.top_ks.tolist() == [32, 32]
    assert info.output_counts is None and info.seen_mask is None
    assert info.logit_bias is None and info.stop_mask is None
    assert not (info.need_top_k or info.need_top_p or info.need_min_p)


def test_batch_mismatch_raises():
    reqs = [make_req()]
    info = SamplingBatchInfo.from_reqs(reqs, 8, torch.device("cpu"))
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 8), info, reqs, False, 0)
