"""Frozen configuration: ``EngineArgs`` (engine flags, SGLang names) and ``ModelConfig``
(read once from a Hugging Face ``config.json`` or GGUF metadata)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class EngineArgs:
    """Engine flags with SGLang's names. ``device`` "auto" = cuda if available, else cpu.

    KV capacity: ``max_total_tokens`` if set, else ``mem_fraction_static`` of free device memory
    (on CPU: of available RAM, capped at ``context_length * max_running_requests``).
    """

    model_path: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    tokenizer_path: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"
    context_length: int | None = None
    page_size: int = 1
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int = 16384
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    disable_radix_cache: bool = False
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    random_seed: int | None = None
    tp_size: int = 1
    # multi-node TP, SGLang's flags: ranks node_rank * tp_size // nnodes ... run on this node;
    # dist_init_addr "host:port" of global rank 0's TCPStore (None: a free local port)
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    attention_backend: str | None = None  # torch | flashinfer; None = by device
    # CUDA graphs for DECODE (flashinfer backend only): batch-size buckets up to this size
    # (None = min(256, max_running_requests)); disable_cuda_graph runs every step eagerly
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    # overlap scheduling (CUDA only): launch decode step N+1 before finishing step N
    disable_overlap_schedule: bool = False
    weight_version: str = "default"
    skip_warmup: bool = False
    # test-only: seconds to sleep before declaring ready (documented in README: it makes the
    # pre-ready phase longer than the health timeout to prove the heartbeat reset)
    debug_startup_delay: float = 0.0

    @property
    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def resolved_tokenizer_path(self) -> str:
        return self.tokenizer_path or self.model_path

    def torch_dtype(self, model_config: "ModelConfig") -> torch.dtype:
        if self.dtype == "auto":
            # float32 on CPU keeps the exact-parity guarantees; bf16 on GPU
            return torch.bfloat16 if self.resolved_device.startswith("cuda") else torch.float32
        return {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                "half": torch.float16, "float16": torch.float16}[self.dtype]


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape, from an HF ``config.json`` dict.

    ``architecture`` is one of LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM.
    ``rope_scaling`` is None or HF's dict (``rope_type`` "default" or "llama3").
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            raise ValueError(f"unsupported architecture {arch!r}")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if kind not in ("default", "llama3"):
                raise ValueError(f"unsupported rope_scaling type {kind!r}")
            if kind == "default":
                rope_scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            raw=cfg,
        )

    @classmethod
    def from_path(cls, model_path: str) -> "ModelConfig":
        with open(os.path.join(model_path, "config.json")) as f:
            return cls.from_dict(json.load(f))
