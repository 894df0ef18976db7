"""Tiny randomly initialised HF checkpoints (Llama, Qwen2, Qwen3) written to a temp folder."""

import os

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config)

TINY = {
    # GQA, untied head, llama3 rope scaling
    "llama": lambda: LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # q/k/v bias, tied head
    "qwen2": lambda: Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    # per-head q/k norm, head_dim != hidden / heads, 1 KV head
    "qwen3": lambda: Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}


def make_tiny(kind: str, folder: str, seed: int = 0) -> str:
    """Save a random tiny model of ``kind`` under ``folder``; returns its path."""
    path = os.path.join(folder, kind)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(TINY[kind](), torch_dtype=torch.float32)
    with torch.no_grad():  # larger weights than the init so logits are not all near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    return path
