"""Offline throughput: N ShareGPT prompts through Eyrie's Engine and through transformers'
``generate()`` on the same model, weights and device; output tokens/s side by side.

    python bench/offline.py --num-prompts 32 --max-new-tokens 64            # SmolLM2 (default)
    python bench/offline.py --model-path tests/fixtures/stories260K --no-chat

Both sides decode greedily with ``ignore_eos`` so they produce the same number of tokens.
transformers runs in batches of ``--hf-batch-size`` (left padding), Eyrie gets all prompts at
once (continuous batching).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.engine import Engine  # noqa: E402
from engine.tokenizer import apply_chat_template  # noqa: E402
from engine.weights.loader import iter_weights, resolve_model_path  # noqa: E402

DEFAULT_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                            "sharegpt-prompts.jsonl")


def load_prompts(path: str, n: int, tokenizer, chat: bool, max_prompt_len: int) -> list[list[int]]:
    out = []
    with open(path) as f:
        for line in f:
            text = json.loads(line)["prompt"]
            ids = (apply_chat_template(tokenizer, [{"role": "user", "content": text}]) if chat
                   else tokenizer.encode(text))
            if len(ids) <= max_prompt_len:
                out.append(ids)
            if len(out) == n:
                break
    return out


def hf_model(model_path: str, engine: Engine):
    """A transformers LlamaForCausalLM holding the same (dequantised) weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = engine.scheduler.model_config
    if os.path.exists(os.path.join(model_path, "config.json")):
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg.raw), dtype=torch.float32)
    model.load_state_dict(dict(iter_weights(model_path, "auto")), strict=False)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def run_hf(model, prompts, max_new, batch_size, pad_id) -> tuple[int, float]:
    t0, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                 min_new_tokens=max_new, do_sample=False, pad_token_id=pad_id)
        tokens += (out.shape[1] - width) * len(chunk)
    return tokens, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dataset-path", default=DEFAULT_DATA)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--no-chat", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    engine = Engine(model_path=args.model_path)
    prompts = load_prompts(args.dataset_path, args.num_prompts, engine.tokenizer,
                           not args.no_chat, args.max_prompt_len)
    sp = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    engine.generate(input_ids=prompts[:1], sampling_params=sp)  # warm-up
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=sp)
    e_time = time.perf_counter() - t0
    e_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    rows = [("eyrie", e_tokens, e_time)]
    if not args.skip_hf:
        model = hf_model(resolve_model_path(args.model_path), engine)
        pad = engine.tokenizer.pad_token_id or 0
        rows.append(("transformers", *run_hf(model, prompts, args.max_new_tokens,
                                             args.hf_batch_size, pad)))
    print(f"model={args.model_path or 'SmolLM2-135M-Instruct (GGUF)'} prompts={len(prompts)} "
          f"input_tokens={sum(map(len, prompts))} max_new_tokens={args.max_new_tokens} "
          f"threads={torch.get_num_threads()}")
    print("| engine | output tokens | seconds | output tok/s |\n|---|---|---|---|")
    for name, toks, secs in rows:
        print(f"| {name} | {toks} | {secs:.2f} | {toks / secs:.1f} |")


if __name__ == "__main__":
    main()
