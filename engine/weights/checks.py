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
