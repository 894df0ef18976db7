"""Checks and views shared by the weight-update paths: the full HF shape of a weight name,
checkpoint/config compatibility, and this rank's view of an HF name inside fused parameters."""

from __future__ import annotations

import torch
from torch import nn

# ModelConfig fields a checkpoint must share with the served model to be swapped in place
SAME_CONFIG_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size",
                      "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                      "tie_word_embeddings", "attention_bias", "qk_norm")


def hf_shape(name: str, cfg) -> tuple[int, ...] | None:
    """The full (unsharded) HF shape of Llama/Qwen2/Qwen3 weight ``name``, or None if unknown."""
    h, d, v, inter = cfg.hidden_size, cfg.head_dim, cfg.vocab_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    table = (("embed_tokens.weight", (v, h)), ("lm_head.weight", (v, h)),
             ("q_proj.weight", (q, h)), ("q_proj.bias", (q,)), ("k_proj.weight", (kv, h)),
             ("k_proj.bias", (kv,)), ("v_proj.weight", (kv, h)), ("v_proj.bias", (kv,)),
             ("o_proj.weight", (h, q)), ("gate_proj.weight", (inter, h)),
             ("up_proj.weight", (inter, h)), ("down_proj.weight", (h, inter)),
             ("q_norm.weight", (d,)), ("k_norm.weight", (d,)), ("norm.weight", (h,)))
    for suffix, shape in table:
        if name == suffix or name.endswith("." + suffix):
            return shape
    return None


def check_same_config(new, cur) -> None:
    """Raise ValueError naming the first ``SAME_CONFIG_FIELDS`` entry where the ModelConfigs
    ``new`` and ``cur`` differ (such a checkpoint cannot be swapped in place)."""
    for f in SAME_CONFIG_FIELDS:
        if getattr(new, f) != getattr(cur, f):
            raise ValueError(f"config.{f} is {getattr(new, f)!r}, the served model has "
                             f"{getattr(cur, f)!r}")


def hf_view(model: nn.Module, name: str) -> torch.Tensor:
    """This rank's shard of ``name``: one of our parameter names, or an HF name inside a
    fused parameter (``k_proj`` -> its rows of ``qkv_proj``; ``up_proj`` -> of
    ``gate_up_proj``). Raises KeyError for an unknown or unstored (tied) name."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if name in params:
        return params[name].data
    resolved = model.resolve_param(name, params)
    if resolved is None:
        raise KeyError(f"{name!r} is not a stored parameter")
    p, shard = resolved
    if shard is None:
        return p.data
    layer = p.weight_loader.__self__  # the fused layer: it knows its sub-shard sizes
    if isinstance(shard, str):  # q / k / v
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        start, n = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
    else:
        start, n = sum(layer.out_sizes[:shard]), layer.out_sizes[shard]
    return p.data.narrow(0, start, n)


def check_layout(model: nn.Module, cfg, named: list[tuple[str, torch.Tensor]], load_format,
                 require_all: bool) -> list[tuple]:
    """Check HF-named tensors (or, with ``load_format="direct"``, our fused parameter names
    with this rank's shard shapes) against ``model`` without changing it: names, full shapes
    (``hf_shape``), floating dtypes, and a dry run of each parameter's ``weight_loader`` on
    ``meta`` tensors. ``require_all``: every parameter, and every part of a fused one (q, k, v;
    gate, up), must be present (a tied ``lm_head`` excepted).

    Returns (param, shard, loader) per tensor, (None, None, None) for one the model skips.
    Raises KeyError (unknown name) or ValueError naming the tensor."""
    params = dict(model.named_parameters(remove_duplicate=False))
    layout, seen = [], set()
    for name, t in named:
        if not t.is_floating_point():
            raise ValueError(f"{name}: dtype {t.dtype} is not a floating-point type")
        if load_format == "direct":
            p = params.get(name)
            if p is None:
                raise KeyError(f"unknown parameter {name!r} (direct uses fused names)")
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)} does not match this "
                                 f"rank's parameter shape {tuple(p.shape)}")
            layout.append((p, None, None))
            seen.add((id(p), None))
            continue
        resolved = model.resolve_param(name, params)
        if resolved is None:
            layout.append((None, None, None))
            continue
        p, shard = resolved
        want = hf_shape(name, cfg)
        if want is not None and tuple(t.shape) != want:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {want}")
        loader = getattr(p, "weight_loader", None)
        if loader is not None:
            try:
                meta_p = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                loader(meta_p, torch.empty(t.shape, dtype=p.dtype, device="meta"), shard)
            except (RuntimeError, ValueError, IndexError) as e:
                raise ValueError(f"{name}: {e}") from None
        elif tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        layout.append((p, shard, loader))
        seen.add((id(p), shard))
    if require_all:
        for k, p in params.items():
            lost = [part for part in model.fused_parts(k) or [None] if (id(p), part) not in seen]
            if lost and not (k == "lm_head.weight" and cfg.tie_word_embeddings):
                what = k if lost == [None] else f"{k} (part {lost[0]!r})"
                raise ValueError(f"checkpoint has no weights for {what}")
    return layout
