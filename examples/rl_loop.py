"""A toy RL loop: a trainer process pushes new weights into a running Eyrie server between
rollouts and checks that they took effect.

    python -m server --model-path tests/fixtures/stories260K --port 30000 &
    python examples/rl_loop.py --url http://127.0.0.1:30000 \
        --model-path tests/fixtures/stories260K --steps 3 --path tensor

Each step: rollout (greedy, token-id prompts) -> "train" (add seeded noise to every weight: a
stand-in for an optimizer step) -> pause generation in place -> push the weights (``--path``
tensor | bucket | distributed over a gloo group) with ``weight_version=step-k`` -> continue ->
check: the probe weight reads back what was pushed, the rollout's ``meta_info.weight_version``
is ``step-k`` and its tokens changed. The original weights are pushed back at the end and the
first rollout must reappear. Exits 1 on any failed check. Tensors live on ``--device`` (cuda
sends CUDA IPC handles: the server must run on the same GPU).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.weights.loader import iter_weights  # noqa: E402
from engine.weights.trainer_client import TrainerClient  # noqa: E402

PROMPTS = [[1, 403, 407, 261, 378], [1, 334, 300, 450], [1, 68, 77, 99]]
PROBE = "model.layers.0.mlp.up_proj.weight"


def rollout(client: TrainerClient, max_new: int) -> tuple[list[list[int]], set[str]]:
    res = client.generate(PROMPTS, max_new)
    return [r["output_ids"] for r in res], {r["meta_info"]["weight_version"] for r in res}


def train_step(weights: dict[str, torch.Tensor], step: int, lr: float) -> None:
    """In place: w += lr * std(w) * N(0, 1), seeded by ``step``."""
    g = torch.Generator().manual_seed(step)
    for t in weights.values():
        noise = torch.randn(t.shape, generator=g).to(t.device, t.dtype)
        t.add_(noise * (lr * float(t.float().std()) if t.numel() > 1 else lr))


def push(client: TrainerClient, weights: dict[str, torch.Tensor], how: str, version: str,
         group) -> dict:
    named = list(weights.items())
    if how == "distributed":
        return client.update_weights_from_distributed(group, named, weight_version=version)
    fmt = "flattened_bucket" if how == "bucket" else None
    return client.update_weights_from_tensor(named, load_format=fmt, weight_version=version)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--model-path", required=True, help="the checkpoint the server started from")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--path", choices=["tensor", "bucket", "distributed"], default="tensor")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    client = TrainerClient(args.url)
    original = {n: t.float().to(args.device) for n, t in iter_weights(args.model_path, "auto")}
    weights = {n: t.clone() for n, t in original.items()}
    group = None
    if args.path == "distributed":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        group = client.init_weights_update_group("127.0.0.1", port,
                                                 world_size=1 + client.tp_size, backend="gloo")
    failures = []
    try:
        first, _ = rollout(client, args.max_new_tokens)
        prev = first
        for step in range(1, args.steps + 1):
            train_step(weights, step, args.lr)
            version = f"step-{step}"
            client.pause_generation("in_place")
            try:
                r = push(client, weights, args.path, version, group)
            finally:
                client.continue_generation()
            outs, versions = rollout(client, args.max_new_tokens)
            probe = client.get_weights_by_name(PROBE, 2)
            ok_probe = torch.allclose(torch.tensor(probe), weights[PROBE][:2].float().cpu())
            checks = {"update accepted": r.get("success"), "probe reads back": ok_probe,
                      "version in meta_info": versions == {version},
                      "/weight_version": client.weight_version() == version,
                      "tokens changed": outs != prev}
            print(f"step {step}: {r.get('message')}")
            for what, ok in checks.items():
                print(f"  {'ok  ' if ok else 'FAIL'} {what}")
                if not ok:
                    failures.append(f"step {step}: {what}")
            prev = outs
        push(client, original, args.path, "restored", group)
        back, _ = rollout(client, args.max_new_tokens)
        print(f"restore: {'ok  ' if back == first else 'FAIL'} first rollout reappears")
        if back != first:
            failures.append("restore")
    finally:
        if group is not None:
            client.destroy_weights_update_group(group)
        client.close()
    print("all checks passed" if not failures else f"{len(failures)} checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
