"""``/update_weights_from_tensor`` latency through HTTP with CUDA IPC (colocated RL).

Starts ``python -m server`` on a Llama-3.1-8B-shaped model with dummy bf16 weights, builds the
same full HF state dict on the same GPU in this (trainer) process, and times complete updates
(serialize IPC handles -> HTTP -> every engine rank opens its handles, checks, copies -> reply):

* per-tensor: ``load_format=None``, one IPC handle per tensor (291 tensors);
* flattened_bucket: one uint8 bucket (one IPC handle); the bucket is built once outside the
  timed loop, as a trainer that keeps its weights in a bucket would.

Targets (issue 6): flattened_bucket <= 20 ms, per-tensor <= 60 ms on an H200.

    python bench/update_weights.py --iters 20 [--tp-size 1] [--output bench/results/x.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.one_batch import LLAMA_8B  # noqa: E402
from engine.weights.trainer_client import TrainerClient, tensor_payloads  # noqa: E402

STORIES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                       "fixtures", "stories260K")


def hf_state_dict(cfg: dict, device: str) -> list[tuple[str, torch.Tensor]]:
    """Full HF-named bf16 tensors of a Llama model with config ``cfg`` (random values)."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
                 "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
                 "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                 "mlp.down_proj": (h, inter), "input_layernorm": (h,),
                 "post_attention_layernorm": (h,)}
        shapes.update({f"{p}{k}.weight": s for k, s in layer.items()})
    return [(n, torch.randn(s, dtype=torch.bfloat16, device=device) * 0.02)
            for n, s in shapes.items()]


def start_server(model_dir: str, port: int, tp: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server", "--model-path", model_dir, "--load-format", "dummy",
           "--tokenizer-path", STORIES, "--port", str(port), "--tp-size", str(tp),
           "--mem-fraction-static", "0.5", "--max-running-requests", "8"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health_generate", timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server not ready")


def device_used_mib() -> float:
    """Memory in use on this GPU by all processes (trainer + server), MiB."""
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def time_updates(client: TrainerClient, named, load_format, iters: int):
    """Wall-clock seconds of ``iters`` complete updates (after 3 warm-up updates), the device
    memory in use (MiB) after the first and the last update, and the median seconds spent
    building the payload (IPC handles + pickle + base64) inside those updates."""
    out, used, ser_s = [], [], []
    for i in range(iters + 3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        tensor_payloads(named, client.tp_size, load_format)  # timed apart, same work
        ser_s.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = client.update_weights_from_tensor(named, load_format=load_format, flush_cache=True)
        dt = time.perf_counter() - t
        assert r["success"], r
        if i == 0 or i == iters + 2:
            used.append(device_used_mib())
        if i >= 3:
            out.append(dt)
    return out, used, statistics.median(ser_s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--output", default=None, help="append a dated markdown table here")
    args = ap.parse_args()
    port = args.port or _free_port()
    url = f"http://127.0.0.1:{port}"
    tmp = tempfile.mkdtemp(prefix="eyrie-8b-")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(LLAMA_8B, f)
    log = open(os.path.join(tmp, "server.log"), "w")
    proc = start_server(tmp, port, args.tp_size, log)
    try:
        wait_ready(url, proc)
        client = TrainerClient(url)
        named = hf_state_dict(LLAMA_8B, "cuda")
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        from engine.weights.serialization import FlattenedTensorBucket
        bucket = FlattenedTensorBucket.from_named_tensors(named)
        rows = []
        for label, payload, fmt in (("per-tensor", named, None),
                                    ("flattened_bucket", bucket, "flattened_bucket")):
            ts, used, ser_s = time_updates(client, payload, fmt, args.iters)
            med = statistics.median(ts)
            rows.append((label, len(named), nbytes / 2**30, med * 1e3, min(ts) * 1e3,
                         max(ts) * 1e3, nbytes / med / 1e9, ser_s * 1e3, used[0], used[1]))
        probe = client.get_weights_by_name("model.layers.0.mlp.up_proj.weight", 1)[0][:3]
        ref = named[[n for n, _ in named].index("model.layers.0.mlp.up_proj.weight")][1][0, :3]
        assert torch.allclose(torch.tensor(probe), ref.float().cpu()), (probe, ref)
        table = _table(rows, args)
        print(table)
        log.flush()
        with open(log.name) as f:  # the server's own phase timings of the last updates
            phases = [ln.rstrip() for ln in f if "update_weights_from_tensor:" in ln
                      or "weights copied" in ln]
        print("\n".join(phases[-4:]))
        if args.output:
            with open(args.output, "a") as f:
                f.write(table + "\n")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _table(rows, args) -> str:
    dev = torch.cuda.get_device_name()
    lines = [f"### update_weights_from_tensor, Llama-3.1-8B shape, bf16, tp={args.tp_size} "
             f"({datetime.date.today()}, {dev})", "",
             f"`python bench/update_weights.py --iters {args.iters} --tp-size {args.tp_size}`", "",
             "| load_format | tensors | GiB | median ms | min ms | max ms | GB/s | payload "
             "build ms | GPU MiB after update 1 | after last |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.1f} | "
              f"{r[6]:.0f} | {r[7]:.1f} | {r[8]:.0f} | {r[9]:.0f} |" for r in rows]
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
