"""Client side of the weight-update API, for RL trainers (httpx; no server imports).

    client = TrainerClient("http://127.0.0.1:30000")
    client.update_weights_from_tensor(list(model.state_dict().items()), weight_version="step-7")

Payload rules (sglang-facts.md section 2.2): the request carries one serialized entry per
inference TP rank, indexed by the deployment ``tp_rank``; tensors are full HF-named tensors
(each rank keeps its own shard). CUDA tensors go as CUDA IPC handles (the server opens them on
the same GPU: colocated RL), so they must stay alive until the call returns; CPU tensors go by
value. A ``LocalSerializedTensor`` gives a different tensor to each rank.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import httpx
import torch

from engine.weights.serialization import (FlattenedTensorBucket, LocalSerializedTensor,
                                          serialize)
from engine.weights.update_group import UpdateGroup, join_update_group

NamedTensors = Sequence[tuple[str, Any]]  # Any: a torch.Tensor or a LocalSerializedTensor


def local_serialized(per_rank: Sequence[torch.Tensor]) -> LocalSerializedTensor:
    """``values[r]`` = ``per_rank[r]`` serialized (each ideally on TP rank r's GPU)."""
    return LocalSerializedTensor(values=[serialize(t) for t in per_rank])


def tensor_payloads(named: NamedTensors | Sequence[NamedTensors], tp_size: int,
                    load_format: str | None = None) -> list[str]:
    """The ``serialized_named_tensors`` list (base64 strings, one per TP rank).

    ``named``: one list of (name, tensor) sent to every rank, or a list of ``tp_size`` such
    lists (rank r gets entry r). ``load_format="flattened_bucket"`` packs each list into one
    ``FlattenedTensorBucket`` (all its tensors on one device); a ready ``FlattenedTensorBucket``
    is sent as is (no re-packing: keep one per trainer and refill it)."""
    if isinstance(named, FlattenedTensorBucket):
        return [serialize(named.to_payload(), output_str=True)] * tp_size
    per_rank = _is_per_rank(named)
    lists = list(named) if per_rank else [named]
    if per_rank and len(lists) != tp_size:
        raise ValueError(f"{len(lists)} per-rank lists for tp_size {tp_size}")
    if load_format == "flattened_bucket":
        encoded = [serialize(FlattenedTensorBucket.from_named_tensors(list(x)).to_payload(),
                             output_str=True) for x in lists]
    else:
        encoded = [serialize(list(x), output_str=True) for x in lists]
    return encoded if per_rank else encoded * tp_size


def _is_per_rank(named: Any) -> bool:
    return bool(named) and isinstance(named[0], (list, tuple)) and bool(named[0]) and \
        isinstance(named[0][0], (list, tuple))


class TrainerClient:
    """Synchronous client. Every update method returns the server's JSON
    (``{success, message}``) and raises ``httpx.HTTPStatusError`` on a non-2xx answer when
    ``check`` is true (the default)."""

    def __init__(self, base_url: str, timeout: float = 600.0, api_key: str | None = None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, timeout=timeout, headers=headers)
        self._tp_size: int | None = None

    def close(self) -> None:
        self.http.close()

    @property
    def tp_size(self) -> int:
        if self._tp_size is None:
            self._tp_size = int(self.http.get("/server_info").json().get("tp_size", 1))
        return self._tp_size

    def _post(self, path: str, body: dict, check: bool = True) -> dict:
        r = self.http.post(path, json=body)
        if check:
            r.raise_for_status()
        return r.json()

    # ---- updates ------------------------------------------------------------------------
    def update_weights_from_tensor(self, named: NamedTensors | Sequence[NamedTensors] |
                                   FlattenedTensorBucket,
                                   load_format: str | None = None, flush_cache: bool = True,
                                   weight_version: str | None = None,
                                   abort_all_requests: bool = False, check: bool = True) -> dict:
        """Send ``named`` (see ``tensor_payloads``); waits until the server applied it."""
        body = {"serialized_named_tensors": tensor_payloads(named, self.tp_size, load_format),
                "load_format": load_format, "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests, "weight_version": weight_version}
        try:
            return self._post("/update_weights_from_tensor", body, check)
        finally:
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()  # release IPC bookkeeping of tensors the server closed

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                 flush_cache: bool = True, check: bool = True) -> dict:
        return self._post("/update_weights_from_disk", {
            "model_path": model_path, "weight_version": weight_version,
            "flush_cache": flush_cache}, check)

    def init_weights_update_group(self, master_address: str, master_port: int, world_size: int,
                                  backend: str = "gloo", group_name: str = "weight_update_group",
                                  rank_offset: int = 1, device: str = "cpu") -> UpdateGroup:
        """Host the group as rank 0 and have the server join (ranks ``rank_offset`` ...).
        Returns the trainer's ``UpdateGroup``. Raises RuntimeError if the server refused."""
        result: dict[str, Any] = {}

        def ask() -> None:
            try:
                result["resp"] = self._post("/init_weights_update_group", {
                    "master_address": master_address, "master_port": master_port,
                    "rank_offset": rank_offset, "world_size": world_size,
                    "group_name": group_name, "backend": backend}, check=False)
            except Exception as e:  # surfaced below
                result["resp"] = {"success": False, "message": repr(e)}

        t = threading.Thread(target=ask, daemon=True)
        t.start()
        group = join_update_group(master_address, master_port, 0, world_size, group_name,
                                  backend, torch.device(device))
        t.join()
        if not result["resp"].get("success"):
            group.destroy()
            raise RuntimeError(f"server did not join: {result['resp'].get('message')}")
        return group

    def update_weights_from_distributed(self, group: UpdateGroup, named: NamedTensors,
                                        load_format: str | None = None, flush_cache: bool = True,
                                        weight_version: str | None = None) -> dict:
        """Broadcast ``named`` (full HF tensors on the group's device) to the server."""
        named = [(n, t.detach().contiguous()) for n, t in named]
        body = {"names": [n for n, _ in named],
                "dtypes": [str(t.dtype).replace("torch.", "") for _, t in named],
                "shapes": [list(t.shape) for _, t in named], "group_name": group.name,
                "flush_cache": flush_cache, "weight_version": weight_version,
                "load_format": load_format}
        out: dict[str, Any] = {}

        def ask() -> None:
            try:
                out["resp"] = self._post("/update_weights_from_distributed", body, check=False)
            except Exception as e:
                out["resp"] = {"success": False, "message": repr(e)}

        t = threading.Thread(target=ask, daemon=True)
        t.start()
        if load_format == "flattened_bucket":
            group.broadcast([FlattenedTensorBucket.from_named_tensors(named).flattened_tensor])
        else:
            group.broadcast([t for _, t in named])
        t.join()
        return out["resp"]

    def destroy_weights_update_group(self, group: UpdateGroup) -> dict:
        resp = self._post("/destroy_weights_update_group", {"group_name": group.name}, False)
        group.destroy()
        return resp

    # ---- reads and control ----------------------------------------------------------------
    def get_weights_by_name(self, name: str, truncate_size: int = 100, tp_rank: int = 0) -> Any:
        r = self.http.post("/get_weights_by_name", json={
            "name": name, "truncate_size": truncate_size, "tp_rank": tp_rank})
        r.raise_for_status()
        return r.json()

    def pause_generation(self, mode: str = "abort") -> dict:
        return self._post("/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        return self._post("/continue_generation", {})

    def weight_version(self) -> str:
        return self.http.get("/weight_version").json()["weight_version"]

    def generate(self, input_ids: list[list[int]], max_new_tokens: int) -> list[dict]:
        """Greedy completions of a batch of token-id prompts (SGLang's /generate shape)."""
        r = self.http.post("/generate", json={"input_ids": input_ids, "sampling_params": {
            "temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}})
        r.raise_for_status()
        return r.json()
