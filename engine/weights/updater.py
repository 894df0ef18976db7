"""``WeightUpdater``: the engine side of the RL weight-update endpoints, one per TP rank.

Every control method runs on every rank between scheduler steps (the worker broadcasts control
requests to all ranks and merges the answers). Each update is two-phase so that a bad payload
changes nothing: (1) this rank opens its own entry and checks every name, shape and dtype
against the model without touching a parameter; (2) the ranks agree over the CPU group (MIN of
"ok") and only then copy. Payloads are indexed by the **deployment** ``tp_rank`` read from
``ParallelState`` at update time, never an attention-TP rank (sglang-facts.md section 2.7);
which shard a parameter keeps is its own ``weight_loader``'s business.

Load formats (sglang-facts.md section 2.3): None = full HF-named tensors through each param's
``weight_loader``; "direct" = our parameter names with this rank's shard shape, copied as is;
"flattened_bucket" = one ``FlattenedTensorBucket`` per rank, then as None.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from engine.weights import serialization as ser
from engine.weights.checks import check_layout, check_same_config, hf_view
from engine.weights.loader import iter_weights, load_model_config, resolve_model_path
from engine.weights.update_group import UpdateGroup, join_update_group

logger = logging.getLogger(__name__)

LOAD_FORMATS = (None, "direct", "flattened_bucket")
DISK_FORMATS = ("auto", "safetensors", "gguf")


def _err(e: Exception) -> str:
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


class WeightUpdater:
    """Owned by the ``Scheduler`` (``scheduler.weights``); reads the model, device and
    ``ParallelState`` through ``scheduler.runner``. Public methods are control methods: they
    return ``(success, message)`` or plain data and never raise for a bad request."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.model_path = resolve_model_path(scheduler.args.model_path)
        self.groups: dict[str, UpdateGroup] = {}
        self._layout: tuple | None = None  # (key, checked layout) of the last payload

    @property
    def runner(self):
        return self.scheduler.runner

    @property
    def ps(self):
        return self.runner.ps

    # ------------------------------------------------------------------ control methods
    def update_weights_from_tensor(self, serialized_named_tensors: list, load_format=None,
                                   flush_cache: bool = True, weight_version: str | None = None):
        """Open entry ``[ps.tp_rank]`` of ``serialized_named_tensors`` (bytes or base64, one per
        deployment TP rank), check it, agree, copy. Returns (success, message)."""
        plan, err, t0 = None, None, time.perf_counter()
        try:
            named = self._open_entry(serialized_named_tensors, load_format)
            t1 = time.perf_counter()
            plan = self._plan(named, load_format)
            logger.info("update_weights_from_tensor: %d tensors opened in %.1f ms, checked in "
                        "%.1f ms", len(named), (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)
        except Exception as e:
            err = _err(e)
        return self._commit(plan, err, flush_cache, weight_version)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 flush_cache: bool = True, weight_version: str | None = None):
        """Swap in the checkpoint at ``model_path`` (same architecture and shapes). Every
        tensor is read and checked before any is copied; if copying still fails the old
        checkpoint is reloaded. Returns (success, message, {"num_paused_requests": n}), n =
        the requests held paused (in place or retracted) across the swap (SGLang's field)."""
        fmt = load_format or self.scheduler.args.load_format
        fmt = "auto" if fmt in (None, "dummy") else fmt
        plan, err = None, None
        try:
            if fmt not in DISK_FORMATS:
                raise ValueError(f"load_format must be one of {', '.join(DISK_FORMATS)} or null, "
                                 f"got {load_format!r}")
            check_same_config(load_model_config(model_path), self.scheduler.model_config)
            plan = self._plan(list(iter_weights(model_path, fmt)), None, require_all=True)
        except Exception as e:
            err = f"{type(e).__name__}: {_err(e)}" if isinstance(e, OSError) else _err(e)
        ok, msg = self._commit(plan, err, flush_cache, weight_version,
                               rollback_path=self.model_path)
        if ok:
            self.model_path = model_path
        s = self.scheduler
        paused = len(s.running) + len(s.waiting) if s.paused else 0
        return ok, msg, {"num_paused_requests": paused}

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "nccl"):
        """Join the trainer's group as rank ``rank_offset + ps.tp_rank`` (blocks until every
        member joined). Returns (success, message)."""
        if group_name in self.groups:
            return False, f"weight update group {group_name!r} already exists"
        tp = self.ps.tp_size
        if not (isinstance(rank_offset, int) and isinstance(world_size, int)) or \
                rank_offset < 1 or rank_offset + tp > world_size:
            return False, (f"rank_offset {rank_offset!r} and world_size {world_size!r} do not "
                           f"fit: the trainer is group rank 0 (it broadcasts), the {tp} engine "
                           f"ranks need ranks rank_offset..rank_offset+{tp - 1} < world_size "
                           f"(usually rank_offset=1, world_size=1+{tp})")
        try:
            self.groups[group_name] = join_update_group(
                master_address, master_port, rank_offset + self.ps.tp_rank, world_size,
                group_name, backend, self.runner.device)
        except Exception as e:
            return False, f"Failed to init weight update group {group_name!r}: {_err(e)}"
        return True, "Succeeded to initialize custom process group."

    def destroy_weights_update_group(self, group_name: str = "weight_update_group"):
        group = self.groups.pop(group_name, None)
        if group is None:
            return False, f"no weight update group {group_name!r}"
        group.destroy()
        return True, "Succeeded to destroy custom process group."

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        flush_cache: bool = True,
                                        weight_version: str | None = None,
                                        load_format: str | None = None):
        """Receive ``names`` by broadcast from group rank 0 (one tensor each, or one uint8
        bucket with ``load_format="flattened_bucket"``, tensors packed in order without
        padding) and load them as full HF tensors. Everything is received even when the
        names are bad (the trainer would hang otherwise), then nothing is copied."""
        group = self.groups.get(group_name)
        if group is None:
            return False, f"no weight update group {group_name!r}; call init_weights_update_group"
        try:
            dts = [getattr(torch, str(d).replace("torch.", "")) for d in dtypes]
            if not all(isinstance(d, torch.dtype) for d in dts) or \
                    not len(names) == len(dts) == len(shapes):
                raise ValueError("names, dtypes and shapes must be lists of equal length")
            bad = next((s for s in shapes if not isinstance(s, (list, tuple)) or not all(
                isinstance(x, int) and x >= 0 for x in s)), None)
            if bad is not None:
                raise ValueError(f"shapes: {bad!r} is not a list of non-negative ints")
        except (AttributeError, TypeError, ValueError) as e:
            return False, f"Failed to update weights: {_err(e)}"  # nothing was broadcast yet
        dev = group.device
        if load_format == "flattened_bucket":
            sizes = [ser._prod(s) * d.itemsize for s, d in zip(shapes, dts)]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
            group.broadcast([flat])
            meta, pos = [], 0
            for n, s, d, nb in zip(names, shapes, dts, sizes):
                meta.append(ser.FlattenedTensorMetadata(n, tuple(s), d, pos, pos + nb,
                                                        ser._prod(s)))
                pos += nb
            named = ser.FlattenedTensorBucket(flat, meta).reconstruct_tensors()
        else:
            tensors = [torch.empty(tuple(s), dtype=d, device=dev) for s, d in zip(shapes, dts)]
            group.broadcast(tensors)
            named = list(zip(names, tensors))
        plan, err = None, None
        try:
            plan = self._plan(named, None)
        except Exception as e:
            err = _err(e)
        return self._commit(plan, err, flush_cache, weight_version)

    def get_weights_by_name(self, name: str, truncate_size: int = 100, tp_rank: int = 0):
        """The first ``truncate_size`` rows of rank ``tp_rank``'s shard of ``name`` (an HF name,
        e.g. ``...k_proj.weight`` reads its rows of the fused ``qkv_proj``, or one of our
        parameter names) as a float nested list; None on the other ranks. Raises KeyError."""
        if tp_rank != self.ps.tp_rank:
            return None
        t = hf_view(self.runner.model, name)
        return t[:truncate_size].float().cpu().tolist()

    def update_weight_version(self, new_version: str):
        self.scheduler.weight_version = new_version
        return True, f"Weight version updated to {new_version}."

    # ------------------------------------------------------------------ phase 1: check
    def _open_entry(self, entries: list, load_format) -> list[tuple[str, torch.Tensor]]:
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be null, 'direct' or 'flattened_bucket', got "
                             f"{load_format!r}")
        ps = self.ps
        if not isinstance(entries, (list, tuple)) or len(entries) != ps.tp_size:
            n = len(entries) if isinstance(entries, (list, tuple)) else "no list"
            raise ValueError(f"serialized_named_tensors must have one entry per TP rank "
                             f"({ps.tp_size}), got {n}")
        obj = ser.deserialize(entries[ps.tp_rank])
        if load_format == "flattened_bucket":
            if isinstance(obj, ser.FlattenedTensorBucket):
                obj = obj.to_payload()
            if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
                raise ValueError("a flattened_bucket entry must be a dict with keys "
                                 "'flattened_tensor' and 'metadata'")
            bucket = ser.FlattenedTensorBucket(self._local(obj["flattened_tensor"], "bucket"),
                                               list(obj["metadata"]))
            return bucket.reconstruct_tensors()
        items = list(obj.items()) if isinstance(obj, dict) else obj
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"an entry must be a list of (name, tensor), got {type(obj).__name__}")
        out = []
        for item in items:
            if not (isinstance(item, (list, tuple)) and len(item) == 2
                    and isinstance(item[0], str)):
                raise ValueError("an entry must be a list of (name, tensor) pairs")
            out.append((item[0], self._local(item[1], item[0])))
        return out

    def _local(self, t: Any, name: str) -> torch.Tensor:
        """Unwrap a LocalSerializedTensor with the deployment rank; check the device."""
        if isinstance(t, ser.LocalSerializedTensor):
            t = t.get(self.ps.tp_rank)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
        dev = self.runner.device
        if t.is_cuda and (dev.type != "cuda" or t.device != dev):
            raise ValueError(f"{name}: tensor opened on {t.device}, but tp_rank "
                             f"{self.ps.tp_rank} runs on {dev}")
        return t

    def _plan(self, named: list[tuple[str, torch.Tensor]], load_format,
              require_all: bool = False) -> list[tuple[nn.Parameter, Any, Any, torch.Tensor]]:
        """(param, shard, loader, tensor) per tensor, after checking names, shapes and dtypes
        (the loader is dry-run on ``meta`` tensors). Raises KeyError/ValueError naming it.
        An RL trainer sends the same names, shapes and dtypes every step, so the checked
        layout of the last payload is kept and reused when the next one has the same key."""
        key = (load_format, require_all, tuple((n, tuple(t.shape), t.dtype) for n, t in named))
        if self._layout is None or self._layout[0] != key:
            self._layout = (key, check_layout(self.runner.model, self.scheduler.model_config,
                                              named, load_format, require_all))
        return [(p, shard, loader, t) for (p, shard, loader), (_, t)
                in zip(self._layout[1], named) if p is not None]

    # ------------------------------------------------------------------ phase 2: commit
    def _commit(self, plan, err: str | None, flush_cache: bool, weight_version: str | None,
                rollback_path: str | None = None):
        ok = self.ps.min_over_ranks(int(err is None)) == 1
        if not ok:
            why = err or "another TP rank rejected its entry"
            return False, f"Failed to update weights: {why}. No weights were changed."
        t0 = time.perf_counter()
        try:
            self._apply(plan)
        except Exception as e:  # unexpected after the checks: restore what we can
            logger.exception("weight copy failed after validation")
            if rollback_path is None:
                return False, f"Failed to update weights: {_err(e)}. Weights may be partially " \
                              "updated."
            self._apply(self._plan(list(iter_weights(rollback_path, "auto")), None))
            return False, f"Failed to update weights: {_err(e)}. Rolled back to {rollback_path}."
        msg = "Succeeded to update model weights."
        t1 = time.perf_counter()
        if flush_cache:
            msg += " " + self._flush()
        logger.info("weights copied in %.1f ms (synchronized), cache flushed in %.1f ms",
                    (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)
        if weight_version is not None:
            self.scheduler.weight_version = weight_version
            msg += f" Weight version updated to {weight_version}."
        return True, msg

    @torch.no_grad()
    def _apply(self, plan) -> None:
        for p, shard, loader, t in plan:
            t = t.to(device=p.device, dtype=p.dtype)
            if loader is None:
                p.data.copy_(t)
            else:
                loader(p, t, shard)
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)  # the sender may free its tensors next

    def _flush(self) -> str:
        """Drop KV computed with the old weights. Requests paused in place keep theirs (SGLang:
        their KV stays); only the unpinned part of the prefix cache goes then."""
        s = self.scheduler
        if not s.running and all(r.req_pool_idx is None for r in s.waiting):
            s.tree.reset()
            s.allocator.clear()
            s.req_pool.clear()
            return "Cache flushed."
        s.tree.evict(s.allocator.capacity_tokens)
        return f"Prefix cache flushed; {len(s.running)} running requests keep their KV."
