"""Weight sources: safetensors (single file or sharded with ``model.safetensors.index.json``),
GGUF (dequantised through the ``gguf`` package) and ``dummy`` (random weights of the right
shapes, for benchmarks). All yield full HF-named tensors; each parameter keeps its own shard."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.distributed.parallel_state import ParallelState
from engine.models.llama import LlamaForCausalLM
from engine.weights import gguf_loader


def resolve_model_path(model_path: str | None) -> str:
    """None or "default" -> the embedded SmolLM2-135M-Instruct GGUF."""
    if model_path in (None, "", "default"):
        return gguf_loader.default_model_path()
    return model_path


def load_model_config(model_path: str) -> ModelConfig:
    """From ``config.json`` in a folder, else from the metadata of its (or the given) GGUF."""
    if os.path.isdir(model_path) and os.path.exists(os.path.join(model_path, "config.json")):
        return ModelConfig.from_path(model_path)
    gguf = gguf_loader.find_gguf(model_path)
    if gguf is None:
        raise FileNotFoundError(f"no config.json or .gguf file at {model_path!r}")
    return ModelConfig.from_dict(gguf_loader.gguf_to_hf_config(gguf))


def iter_safetensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_path, x) for x in files]
    else:
        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_path!r}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def iter_weights(model_path: str, load_format: str) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors from ``model_path`` in ``load_format`` (auto | safetensors |
    gguf). Raises FileNotFoundError when nothing loadable is there."""
    gguf = gguf_loader.find_gguf(model_path)
    if load_format == "gguf" or (load_format == "auto" and gguf and
                                 not glob.glob(os.path.join(model_path, "*.safetensors"))):
        if gguf is None:
            raise FileNotFoundError(f"no .gguf file at {model_path!r}")
        return gguf_loader.iter_gguf_tensors(gguf)
    return iter_safetensors(model_path)


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights (normal, std 0.02; norms 1) for speed runs without a checkpoint.

    Drawn in place on each parameter's device (an 8B model fills in well under a second on a
    GPU instead of minutes of CPU ``randn``); one generator per device, seeded with ``seed``.
    """
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            gen = gens.get(p.device)
            if gen is None:
                gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            p.normal_(0.0, 0.02, generator=gen)


def build_model(model_path: str, cfg: ModelConfig, load_format: str, ps: ParallelState,
                dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Build the model on ``device`` and fill its weights. Raises KeyError/ValueError naming a
    tensor that does not fit the model."""
    with torch.device(device):
        model = LlamaForCausalLM(cfg, ps, dtype)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        model.load_weights(iter_weights(model_path, load_format))
    return model.eval()
