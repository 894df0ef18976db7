"""Token sampling: penalties, logit bias, temperature, top-k/top-p/min-p, seeded draws, logprobs.

Semantics follow SGLang's ``SamplingParams`` (shared/reference/sglang-facts.md, section 1.2) and
its sampler (``python/sglang/srt/layers/sampler.py``, ``sampling/penaltylib``):

* greedy rows (``temperature < 1e-6`` or ``top_k == 1``) take the argmax of the penalised,
  biased logits;
* other rows: penalties -> logit_bias -> ``/ temperature`` -> softmax -> top-k -> top-p ->
  min-p (each filter renormalises, FlashInfer's "top_k_first" order) -> draw;
* reported logprobs are ``log_softmax`` of the *unmodified* model logits (SGLang's default
  "raw" logprobs), so they do not depend on temperature or penalties.

Draws use the exponential race (``argmax(p / E)``, ``E ~ Exp(1)`` per token), which samples
exactly from ``p``. A row with ``sampling_seed`` draws its noise from a CPU generator seeded by
``(sampling_seed, len(output_ids))``, so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.types import Req

_GREEDY_EPS = 1e-6
_MASK64 = (1 << 63) - 1


def row_seed(sampling_seed: int, step: int) -> int:
    """Seed for one row's draw: mixes the request seed with the decode step (``len(output_ids)``).

    Golden-ratio multiply-add (as in splitmix64), so consecutive steps get unrelated streams.
    """
    return (sampling_seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) & _MASK64


@dataclass
class SamplingBatchInfo:
    """Per-row sampling tensors for one batch of ``B`` requests over a vocabulary of ``V``.

    ``[B]`` tensors: ``temperatures`` f32 (1.0 on greedy rows), ``top_ps`` f32, ``top_ks`` int64
    (clamped to ``V``; 1 on greedy rows), ``min_ps`` f32, ``frequency_penalties``,
    ``presence_penalties``, ``repetition_penalties`` f32. Dense ``[B, V]`` tensors, ``None`` when
    no row needs them: ``output_counts`` f32 (occurrences of each token in ``output_ids``; SGLang
    counts output tokens only for frequency/presence), ``seen_mask`` bool (token occurs in prompt
    or output; HF's RepetitionPenaltyLogitsProcessor), ``logit_bias`` f32, ``stop_mask`` bool
    (EOS/stop ids banned while ``len(output_ids) < min_new_tokens``). ``seeds[i]`` is the
    generator seed of row ``i`` or ``None`` to use the Sampler's own generator.
    """

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    frequency_penalties: torch.Tensor
    presence_penalties: torch.Tensor
    repetition_penalties: torch.Tensor
    output_counts: torch.Tensor | None
    seen_mask: torch.Tensor | None
    logit_bias: torch.Tensor | None
    stop_mask: torch.Tensor | None
    seeds: list[int | None]
    is_greedy: torch.Tensor  # [B] bool
    is_all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    vocab_size: int

    @classmethod
    def from_reqs(cls, reqs: list[Req], vocab_size: int, device: torch.device,
                  eos_token_ids: tuple[int, ...] = ()) -> "SamplingBatchInfo":
        """Build the batch tensors on ``device`` from ``reqs`` (any length >= 1).

        ``eos_token_ids`` are the model's EOS ids; they are banned below ``min_new_tokens``
        unless the request sets ``ignore_eos`` (then EOS cannot end it anyway). The request's
        ``stop_token_ids`` are always banned below ``min_new_tokens``.
        """
        sps = [r.sampling_params for r in reqs]
        V = vocab_size

        def f32(vals):
            return torch.tensor(vals, dtype=torch.float32, device=device)

        greedy = [sp.is_greedy for sp in sps]
        top_ks = [min(sp.effective_top_k, V) if not g else 1 for sp, g in zip(sps, greedy)]
        temps = [1.0 if g else float(sp.temperature) for sp, g in zip(sps, greedy)]

        output_counts = None
        if any(sp.frequency_penalty != 0 or sp.presence_penalty != 0 for sp in sps):
            output_counts = _scatter_rows([r.output_ids for r in reqs], V, device, count=True)
        seen_mask = None
        if any(sp.repetition_penalty != 1 for sp in sps):
            seen_mask = _scatter_rows([r.fill_ids for r in reqs], V, device, count=False) > 0

        logit_bias = None
        if any(sp.logit_bias for sp in sps):
            logit_bias = torch.zeros(len(reqs), V, dtype=torch.float32)
            for i, sp in enumerate(sps):
                for k, v in (sp.logit_bias or {}).items():
                    logit_bias[i, int(k)] = float(v)
            logit_bias = logit_bias.to(device)

        banned = []
        for r in reqs:
            sp = r.sampling_params
            ids: list[int] = []
            if len(r.output_ids) < sp.min_new_tokens:
                ids = list(sp.stop_token_ids or []) + ([] if sp.ignore_eos else list(eos_token_ids))
            banned.append([t for t in ids if 0 <= t < V])
        stop_mask = None
        if any(banned):
            stop_mask = _scatter_rows(banned, V, device, count=False) > 0

        # the [B] rows travel in one host-to-device copy (top_k and the greedy flag as exact
        # float32: V < 2**24), then split into views / cast on the device
        packed = f32([temps, [float(sp.top_p) for sp in sps], [float(sp.min_p) for sp in sps],
                      [float(sp.frequency_penalty) for sp in sps],
                      [float(sp.presence_penalty) for sp in sps],
                      [float(sp.repetition_penalty) for sp in sps],
                      [float(k) for k in top_ks], [1.0 if g else 0.0 for g in greedy]])
        return cls(
            temperatures=packed[0],
            top_ps=packed[1],
            top_ks=(packed[6].to(torch.int64) if V < 2**24
                    else torch.tensor(top_ks, dtype=torch.int64, device=device)),
            min_ps=packed[2],
            frequency_penalties=packed[3],
            presence_penalties=packed[4],
            repetition_penalties=packed[5],
            output_counts=output_counts,
            seen_mask=seen_mask,
            logit_bias=logit_bias,
            stop_mask=stop_mask,
            seeds=[None if sp.sampling_seed is None else row_seed(sp.sampling_seed,
                                                                  len(r.output_ids))
                   for sp, r in zip(sps, reqs)],
            is_greedy=packed[7] > 0.5,
            is_all_greedy=all(greedy),
            need_top_k=any(k < V for k, g in zip(top_ks, greedy) if not g),
            need_top_p=any(sp.top_p < 1.0 for sp, g in zip(sps, greedy) if not g),
            need_min_p=any(sp.min_p > 0.0 for sp, g in zip(sps, greedy) if not g),
            vocab_size=V,
        )


def plain_greedy(reqs: list[Req], eos_token_ids: tuple[int, ...] = ()) -> bool:
    """True when ``Sampler`` would return the argmax of the raw logits for every request and
    nothing else is needed: all greedy, no logprobs, no penalties, no logit bias, no
    min_new_tokens ban in force. Such a batch can skip ``SamplingBatchInfo`` altogether and
    take ``greedy_next_ids`` (same tokens, no per-row tensors, no host-to-device copies).
    Conservative: a request that only might need the full path (e.g. an out-of-vocabulary
    stop id below min_new_tokens) makes it False."""
    for r in reqs:
        sp = r.sampling_params
        if (not sp.is_greedy or r.return_logprob or sp.frequency_penalty != 0
                or sp.presence_penalty != 0 or sp.repetition_penalty != 1 or sp.logit_bias):
            return False
        if len(r.output_ids) < sp.min_new_tokens and (
                sp.stop_token_ids or (eos_token_ids and not sp.ignore_eos)):
            return False
    return True


def greedy_next_ids(logits: torch.Tensor) -> torch.Tensor:
    """Argmax of each row of ``logits`` [B, V]: [B] int64 on the logits' device, one kernel, no
    host sync. Equals ``Sampler(...).next_token_ids`` on a batch for which ``plain_greedy``
    holds (argmax of the unmodified float32 logits, first index on ties)."""
    return logits.float().argmax(dim=-1)


def _scatter_rows(rows: list[list[int]], vocab_size: int, device: torch.device,
                  count: bool) -> torch.Tensor:
    """[B, V] f32: per row, occurrences of each id (``count``) or 1.0 where it occurs."""
    out = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    width = max((len(r) for r in rows), default=0)
    if width == 0:
        return out
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    ones = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
        ones[i, :len(r)] = 1.0
    out.scatter_add_(1, ids.to(device), ones.to(device))
    return out if count else out.clamp_(max=1.0)


def apply_penalties_and_bias(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Return a penalised, biased copy of ``logits`` [B, V] f32; the input is not modified.

    Order (vLLM's ``apply_penalties``, then SGLang's ``apply_logits_bias``): repetition penalty
    on prompt+output tokens (positive logits divided, negative multiplied, as HF), then
    ``- frequency * count - presence * (count > 0)`` over output tokens (OpenAI / SGLang), then
    the min_new_tokens ban (-inf), then the additive ``logit_bias``.
    """
    logits = logits.clone()
    if info.seen_mask is not None:
        pen = info.repetition_penalties.unsqueeze(1)
        scaled = torch.where(logits > 0, logits / pen, logits * pen)
        logits = torch.where(info.seen_mask, scaled, logits)
    if info.output_counts is not None:
        counts = info.output_counts
        logits -= info.frequency_penalties.unsqueeze(1) * counts
        logits -= info.presence_penalties.unsqueeze(1) * (counts > 0).to(logits.dtype)
    if info.stop_mask is not None:
        logits.masked_fill_(info.stop_mask, float("-inf"))
    if info.logit_bias is not None:
        logits += info.logit_bias
    return logits


def apply_top_k_top_p_min_p(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                            min_ps: torch.Tensor) -> torch.Tensor:
    """Filter and renormalise ``probs`` [B, V] f32 (rows summing to 1); returns a new tensor.

    ``top_ks`` [B] int64 keeps the k most likely tokens (ties broken by lower id). ``top_ps`` [B]
    f32 then keeps the smallest prefix of the sorted, renormalised probs whose mass before each
    kept token is ``<= top_p`` (so the top token always survives; SGLang's
    ``(cumsum - p) > top_p`` rule). ``min_ps`` [B] f32 then drops tokens with
    ``p < min_p * max(p)``. Each step renormalises.
    """
    sorted_p, idx = probs.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    sorted_p = sorted_p.masked_fill(ranks >= top_ks.unsqueeze(1), 0.0)
    sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
    cum = sorted_p.cumsum(dim=-1)
    sorted_p = sorted_p.masked_fill((cum - sorted_p) > top_ps.unsqueeze(1), 0.0)
    sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
    threshold = sorted_p[:, :1] * min_ps.unsqueeze(1)
    sorted_p = sorted_p.masked_fill(sorted_p < threshold, 0.0)
    sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, idx, sorted_p)


@dataclass
class SampleOutput:
    """Result of one sampling step for ``B`` rows.

    ``next_token_ids`` [B] int64. When logprobs were asked for: ``logprobs`` [B] f32 (raw
    logprob of the chosen token), ``top_logprobs_val`` [B, K] f32 and ``top_logprobs_idx``
    [B, K] int64 (K = ``top_logprobs_num``; ``None`` when K == 0).
    """

    next_token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs_val: torch.Tensor | None = None
    top_logprobs_idx: torch.Tensor | None = None


class Sampler:
    """Draws next tokens for a batch. Rows without ``sampling_seed`` share one generator per
    device, seeded from ``seed`` (nondeterministic when ``None``)."""

    def __init__(self, seed: int | None = None):
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            if self.seed is None:
                gen.seed()
            else:
                gen.manual_seed(self.seed)
            self._generators[key] = gen
        return gen

    def _exponential_noise(self, shape: tuple[int, int], seeds: list[int | None],
                           device: torch.device) -> torch.Tensor:
        """[B, V] f32 Exp(1) noise; seeded rows come from their own CPU generator."""
        noise = torch.empty(shape, dtype=torch.float32, device=device)
        noise.exponential_(generator=self._generator(device))
        seeded = [i for i, s in enumerate(seeds) if s is not None]
        if seeded:
            rows = []
            for i in seeded:
                g = torch.Generator().manual_seed(seeds[i])
                rows.append(torch.empty(shape[1], dtype=torch.float32).exponential_(generator=g))
            noise[seeded] = torch.stack(rows).to(device)
        return noise.clamp_(min=torch.finfo(torch.float32).tiny)

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo, reqs: list[Req],
                 return_logprob: bool = False, top_logprobs_num: int = 0) -> SampleOutput:
        """Sample one token per row of ``logits`` [B, V] f32 (not modified).

        ``reqs`` must be the requests ``info`` was built from (same order); raises ValueError
        on a length mismatch. ``top_logprobs_num`` is the largest K wanted in the batch.
        """
        if logits.shape[0] != len(reqs) or len(reqs) != len(info.seeds):
            raise ValueError(f"batch mismatch: logits {tuple(logits.shape)}, {len(reqs)} reqs, "
                             f"{len(info.seeds)} info rows")
        logits = logits.float()
        out = SampleOutput(next_token_ids=torch.empty(0))
        if return_logprob:
            raw = torch.log_softmax(logits, dim=-1)
            if top_logprobs_num > 0:
                k = min(top_logprobs_num, raw.shape[-1])
                out.top_logprobs_val, out.top_logprobs_idx = raw.topk(k, dim=-1)
        modified = apply_penalties_and_bias(logits, info)
        greedy_ids = modified.argmax(dim=-1)
        if info.is_all_greedy:
            next_ids = greedy_ids
        else:
            probs = torch.softmax(modified / info.temperatures.unsqueeze(1), dim=-1)
            if info.need_top_k or info.need_top_p or info.need_min_p:
                probs = apply_top_k_top_p_min_p(probs, info.top_ks, info.top_ps, info.min_ps)
            noise = self._exponential_noise(tuple(probs.shape), info.seeds, probs.device)
            sampled = (probs / noise).argmax(dim=-1)
            next_ids = torch.where(info.is_greedy, greedy_ids, sampled)
        out.next_token_ids = next_ids.to(torch.int64)
        if return_logprob:
            out.logprobs = raw.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
        return out


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                            top_logprobs_num: int
                            ) -> tuple[list[float], list[list[tuple[float, int]]]]:
    """Raw logprobs of prompt tokens, for ``logprob_start_len >= 0``.

    ``logits`` [T, V] (row t is the model's prediction after position t), ``target_ids`` [T]
    int64 (the token that actually followed). Returns ``(token_logprobs, top_logprobs)``:
    ``T`` floats and ``T`` lists of ``(logprob, token_id)`` sorted best first (empty lists when
    ``top_logprobs_num == 0``), the shapes of ``Req.input_token_logprobs`` /
    ``input_top_logprobs`` before the token ids/text are attached.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target_ids = target_ids.to(device=logprobs.device, dtype=torch.int64)
    token_lp = logprobs.gather(1, target_ids.unsqueeze(1)).squeeze(1).tolist()
    if top_logprobs_num <= 0:
        return token_lp, [[] for _ in token_lp]
    vals, idx = logprobs.topk(min(top_logprobs_num, logprobs.shape[-1]), dim=-1)
    top = [list(zip(v, i)) for v, i in zip(vals.tolist(), idx.tolist())]
    return token_lp, top
