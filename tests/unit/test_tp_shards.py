"""Each TP rank loads the right slices of a checkpoint (no process group needed: only the
weight loaders run). Megatron-LM layout: column-parallel layers split output rows, row-parallel
layers split input columns, vocab rows split in ``ceil(V / tp)`` blocks (last one zero-padded),
KV heads split or, when ``tp_size`` exceeds them, replicated (rank r holds head
``r * num_kv_heads // tp_size``)."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.distributed.parallel_state import ParallelState
from engine.models.llama import LlamaForCausalLM
from engine.weights.loader import iter_safetensors
from tests.conftest import STORIES


def _synthetic(heads: int, kv_heads: int, head_dim: int = 4, hidden: int = 16, inter: int = 24,
               vocab: int = 30) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A 1-layer Qwen3-shaped config and random HF-named full tensors (vocab not divisible)."""
    cfg = ModelConfig.from_dict({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "tie_word_embeddings": False})
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}
    p = "model.layers.0."
    shapes.update({p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                   p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                   p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                   p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                   p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight":
                   (head_dim,), p + "mlp.gate_proj.weight": (inter, hidden),
                   p + "mlp.up_proj.weight": (inter, hidden), p + "mlp.down_proj.weight":
                   (hidden, inter), p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,)})
    return cfg, {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _check_rank(cfg: ModelConfig, full: dict[str, torch.Tensor], rank: int, tp: int) -> None:
    model = LlamaForCausalLM(cfg, ParallelState(tp_rank=rank, tp_size=tp), torch.float32)
    model.load_weights(full.items())
    d, heads, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q_rows = heads // tp * d
    kv_local = max(1, kv // tp)
    kv_start = rank * kv_local if kv >= tp else rank * kv // tp  # replicated below kv == tp
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        qkv = layer.self_attn.qkv_proj.weight
        assert torch.equal(qkv[:q_rows], full[p + "self_attn.q_proj.weight"]
                           [rank * q_rows:(rank + 1) * q_rows])
        kv_rows = slice(kv_start * d, (kv_start + kv_local) * d)
        assert torch.equal(qkv[q_rows:q_rows + kv_local * d],
                           full[p + "self_attn.k_proj.weight"][kv_rows])
        assert torch.equal(qkv[q_rows + kv_local * d:], full[p + "self_attn.v_proj.weight"][kv_rows])
        o_cols = slice(rank * q_rows, (rank + 1) * q_rows)
        assert torch.equal(layer.self_attn.o_proj.weight, full[p + "self_attn.o_proj.weight"]
                           [:, o_cols])
        n = cfg.intermediate_size // tp
        rows = slice(rank * n, (rank + 1) * n)
        gate_up = layer.mlp.gate_up_proj.weight
        assert torch.equal(gate_up[:n], full[p + "mlp.gate_proj.weight"][rows])
        assert torch.equal(gate_up[n:], full[p + "mlp.up_proj.weight"][rows])
        assert torch.equal(layer.mlp.down_proj.weight, full[p + "mlp.down_proj.weight"][:, rows])
        assert torch.equal(layer.input_layernorm.weight, full[p + "input_layernorm.weight"])
    per = -(-cfg.vocab_size // tp)
    for ours, name in ((model.model.embed_tokens.weight, "model.embed_tokens.weight"),
                       (model.lm_head.weight, "lm_head.weight")):
        if name not in full:  # tied: the head is the embedding
            name = "model.embed_tokens.weight"
        src = full[name][rank * per:(rank + 1) * per]
        assert ours.shape[0] == per
        assert torch.equal(ours[:src.shape[0]], src)
        assert not ours[src.shape[0]:].any(), "padding rows of the last vocab shard must be 0"


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_loads_its_slices_of_stories260k(tp):
    cfg = ModelConfig.from_path(STORIES)  # 8 q / 4 kv heads, tied embeddings
    full = dict(iter_safetensors(STORIES))
    full = {k: v.float() for k, v in full.items()}
    for rank in range(tp):
        _check_rank(cfg, full, rank, tp)


@pytest.mark.parametrize("heads,kv_heads,tp", [(4, 1, 2), (4, 1, 4), (8, 2, 4), (4, 2, 2)])
def test_kv_heads_replicate_when_tp_exceeds_them(heads, kv_heads, tp):
    cfg, full = _synthetic(heads, kv_heads)
    for rank in range(tp):
        _check_rank(cfg, full, rank, tp)


def test_row_parallel_partial_sums_add_up_to_the_full_projection():
    """The o_proj / down_proj shards' partial products sum to the unsharded result (what the
    all-reduce computes), and the column shards concatenate to the full q projection."""
    cfg, full = _synthetic(4, 2)
    tp, x = 2, torch.randn(3, cfg.num_attention_heads * cfg.head_dim)
    w = full["model.layers.0.self_attn.o_proj.weight"]
    parts = []
    for rank in range(tp):
        model = LlamaForCausalLM(cfg, ParallelState(tp_rank=rank, tp_size=tp), torch.float32)
        model.load_weights(full.items())
        n = x.shape[1] // tp
        parts.append(x[:, rank * n:(rank + 1) * n] @ model.model.layers[0].self_attn.o_proj
                     .weight.T)
    torch.testing.assert_close(sum(parts), x @ w.T)
