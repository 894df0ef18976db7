"""One decoder for Llama, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

Parameter names mirror Hugging Face's except the fused ``qkv_proj`` and ``gate_up_proj``;
``load_weights`` maps HF names onto them through each parameter's ``weight_loader``.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.distributed.parallel_state import ParallelState
from engine.layers.activation import SiluAndMul
from engine.layers.cuda_ops import fused_ok
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                  RowParallelLinear)
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.runner.forward_batch import ForwardBatch

# (our fused param, HF name part, shard id)
_STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


def _replicated(param: nn.Parameter, full: torch.Tensor, shard=None) -> None:
    if param.shape != full.shape:
        raise ValueError(f"shape mismatch: expected {tuple(param.shape)}, got {tuple(full.shape)}")
    param.data.copy_(full)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ps: ParallelState, rope: RotaryEmbedding,
                 dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.attention_bias, ps, dtype)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        False, ps, dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.qk_norm = cfg.qk_norm
        self.rope = rope
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, attn) -> torch.Tensor:
        d = self.head_dim
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q = q.view(-1, self.num_heads, d)
        k = k.view(-1, self.num_kv_heads, d)
        v = v.view(-1, self.num_kv_heads, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(batch.positions, q, k)
        o = attn.forward(q, k, v, self.layer_id, batch, self.scale)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], False, ps,
                                                       dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, ps, dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id, ps, rope, dtype):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, ps, rope, dtype)
        self.mlp = MLP(cfg, ps, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, attn) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ps, dtype)
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                               cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ps, rope, dtype)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """Llama/Qwen2/Qwen3 causal LM. ``forward`` returns float32 logits [R, vocab] for the rows
    ``batch.logits_indices`` and the final hidden states [T, hidden]."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, ps, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ps, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch: ForwardBatch, attn) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.model.embed_tokens(batch.input_ids)
        fi = fused_ok(x)
        if fi is not None and x.shape[-1] % 8 == 0 and len(self.model.layers) > 0:
            hidden = self._forward_fused_norms(fi, x, batch, attn)
        else:
            for layer in self.model.layers:
                x = layer(x, batch, attn)
            hidden = self.model.norm(x)
        return self.lm_head.logits(hidden[batch.logits_indices]), hidden

    def _forward_fused_norms(self, fi, x: torch.Tensor, batch: ForwardBatch, attn) -> torch.Tensor:
        """The decoder stack on CUDA bf16/fp16 with every residual add folded into the next
        RMSNorm: flashinfer ``fused_add_rmsnorm(h, residual, w)`` does ``residual += h;
        h = rmsnorm(residual) * w`` in place (one kernel instead of add + norm). Same function
        as ``DecoderLayer.forward``; the sum is normalised before it is rounded to bf16."""
        layers = self.model.layers
        residual = x  # the embedding output (a fresh tensor) becomes the residual stream
        h = layers[0].input_layernorm(x)
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        for layer, nxt in zip(layers, next_norms):
            h = layer.self_attn(h, batch, attn)
            post = layer.post_attention_layernorm
            fi.fused_add_rmsnorm(h, residual, post.weight, post.eps)
            h = layer.mlp(h)
            fi.fused_add_rmsnorm(h, residual, nxt.weight, nxt.eps)
        return h

    def resolve_param(self, hf_name: str, params: dict[str, nn.Parameter]):
        """Map an HF parameter name to (our parameter, shard id), or None to skip it (rotary
        buffers; ``lm_head`` when tied). ``params``: ``dict(named_parameters(remove_duplicate=
        False))``. Raises KeyError naming an unknown weight."""
        if "rotary_emb" in hf_name or (hf_name == "lm_head.weight" and
                                       self.config.tie_word_embeddings):
            return None
        target, shard = hf_name, None
        for fused, part, sid in _STACKED:
            if f".{part}." in hf_name:
                target, shard = hf_name.replace(part, fused), sid
                break
        if target not in params:
            raise KeyError(f"unknown weight {hf_name!r}")
        return params[target], shard

    @staticmethod
    def fused_parts(param_name: str) -> list:
        """Shard ids a fused parameter is loaded from ([q, k, v] for ``qkv_proj``, [0, 1] for
        ``gate_up_proj``); [] for a parameter loaded from one HF tensor."""
        return [sid for fused, _, sid in _STACKED if f".{fused}." in param_name]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named full tensors into this rank's shards. Raises KeyError / ValueError."""
        params = dict(self.named_parameters(remove_duplicate=False))
        for name, tensor in weights:
            resolved = self.resolve_param(name, params)
            if resolved is None:
                continue
            p, shard = resolved
            with torch.no_grad():
                getattr(p, "weight_loader", _replicated)(p, tensor.to(p.dtype), shard)
