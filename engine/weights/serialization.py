"""Wire format of ``/update_weights_from_tensor`` payloads and the allow-list unpickler.

Facts carried over from SGLang (shared/reference/sglang-facts.md section 2.1), code our own:

* A payload is a pickle (base64 over JSON) of a list of ``(name, tensor)`` pairs, of a
  ``FlattenedTensorBucket``-style dict ``{"flattened_tensor": uint8 [n_bytes], "metadata":
  [FlattenedTensorMetadata, ...]}``, where a tensor may be a ``LocalSerializedTensor`` holding
  one serialized tensor per deployment TP rank.
* CUDA tensors travel as CUDA IPC handles (``torch.multiprocessing.reductions.reduce_tensor``)
  whose device index is replaced by the GPU UUID, because trainer and server may order
  ``CUDA_VISIBLE_DEVICES`` differently; the receiver maps the UUID back to its local index.
  We do this with a ``pickle.Pickler.reducer_override`` on the sending side and in
  ``SafeUnpickler.find_class`` on the receiving side: nothing in torch is patched.
* CPU tensors travel by value: raw bytes + dtype name + shape, rebuilt by our own function
  (never ``torch.load``, which would unpickle nested bytes without an allow-list).

Receiving bytes from HTTP means untrusted input (CVE-2025-10164 in SGLang): ``deserialize``
only resolves the globals listed in ``SafeUnpickler``; anything else raises ``UnsafePayloadError``.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch


class UnsafePayloadError(ValueError):
    """The payload names a global outside the allow-list, or is not a valid pickle/base64."""


# ------------------------------------------------------------------ payload classes
@dataclass
class LocalSerializedTensor:
    """One tensor per deployment TP rank: ``values[r]`` is ``serialize(tensor_for_rank_r)``
    (bytes), typically a CUDA IPC handle of a tensor living on rank r's GPU."""

    values: list[bytes]

    def get(self, tp_rank: int) -> torch.Tensor:
        """Deserialize ``values[tp_rank]`` (the deployment rank). Raises ``ValueError`` when
        there is no value for that rank or it is not a tensor."""
        if not 0 <= tp_rank < len(self.values):
            raise ValueError(f"LocalSerializedTensor has {len(self.values)} values, none for "
                             f"tp_rank {tp_rank}")
        t = deserialize(self.values[tp_rank])
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"LocalSerializedTensor value {tp_rank} is {type(t).__name__}, "
                             "not a tensor")
        return t


@dataclass
class FlattenedTensorMetadata:
    """Where one tensor sits in a flattened bucket: bytes ``[start_idx, end_idx)`` of the
    uint8 buffer, ``numel`` elements of ``dtype`` with ``shape``."""

    name: str
    shape: tuple
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """Many tensors packed into one 1-D uint8 tensor (each flattened and viewed as bytes,
    concatenated without padding) plus metadata; mixed dtypes allowed. One IPC handle or one
    broadcast instead of hundreds (SGLang's ``weight_sync/tensor_bucket.py`` layout)."""

    def __init__(self, flattened_tensor: torch.Tensor, metadata: list[FlattenedTensorMetadata]):
        self.flattened_tensor, self.metadata = flattened_tensor, metadata

    @classmethod
    def from_named_tensors(cls, named: list[tuple[str, torch.Tensor]]) -> "FlattenedTensorBucket":
        """Pack ``named`` (all on one device) into one uint8 buffer on that device."""
        parts, meta, pos = [], [], 0
        for name, t in named:
            b = t.detach().contiguous().reshape(-1).view(torch.uint8)
            meta.append(FlattenedTensorMetadata(name, tuple(t.shape), t.dtype, pos,
                                                pos + b.numel(), t.numel()))
            parts.append(b)
            pos += b.numel()
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        return cls(flat, meta)

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Views into the buffer (copies only where a slice is misaligned for its dtype).
        Raises ``ValueError`` when the metadata does not fit the buffer."""
        flat, out = self.flattened_tensor, []
        if flat.dtype != torch.uint8 or flat.dim() != 1:
            raise ValueError("flattened_tensor must be a 1-D uint8 tensor")
        for m in self.metadata:
            if not isinstance(m, FlattenedTensorMetadata) or not isinstance(m.dtype, torch.dtype):
                raise ValueError("bad flattened-bucket metadata entry")
            nbytes = m.numel * m.dtype.itemsize
            if not 0 <= m.start_idx <= m.end_idx <= flat.numel() or \
                    m.end_idx - m.start_idx != nbytes or _prod(m.shape) != m.numel:
                raise ValueError(f"flattened-bucket metadata of {m.name!r} does not fit the "
                                 f"buffer ({flat.numel()} bytes)")
            piece = flat[m.start_idx:m.end_idx]
            if (flat.storage_offset() + m.start_idx) % m.dtype.itemsize:
                piece = piece.clone()
            out.append((m.name, piece.view(m.dtype).view(m.shape)))
        return out

    def to_payload(self) -> dict[str, Any]:
        return {"flattened_tensor": self.flattened_tensor, "metadata": self.metadata}


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# ------------------------------------------------------------------ tensor reduction
def gpu_uuid(index: int) -> str:
    """The UUID string of local CUDA device ``index`` (stable across CUDA_VISIBLE_DEVICES)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def _uuid_to_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    raise ValueError(f"CUDA device {uuid} is not visible to this process")


def rebuild_cpu_tensor(data: bytes, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A CPU tensor of ``dtype``/``shape`` from its raw little-endian bytes (a copy)."""
    if not isinstance(data, (bytes, bytearray)) or not isinstance(dtype, torch.dtype):
        raise ValueError("bad CPU tensor record")
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)
    if flat.numel() != _prod(shape) * dtype.itemsize:
        raise ValueError("CPU tensor bytes do not match its shape and dtype")
    return flat.view(dtype).reshape(tuple(shape))


def rebuild_cuda_tensor_by_uuid(*args: Any) -> torch.Tensor:
    """Open a CUDA IPC handle whose device field (argument 6 of torch's
    ``rebuild_cuda_tensor``) is a GPU UUID string (or a plain index, as torch writes it)."""
    from torch.multiprocessing import reductions

    args = list(args)
    if isinstance(args[6], str):
        args[6] = _uuid_to_index(args[6])
    if args[0] is None:  # our writer leaves the classes out (what torch itself writes)
        args[0], args[4] = torch.Tensor, torch.storage.TypedStorage
    return reductions.rebuild_cuda_tensor(*args)


class _TensorPickler(pickle.Pickler):
    """Pickler that writes CUDA tensors as UUID-tagged IPC handles and CPU tensors by value."""

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        t = obj.detach()
        if t.is_cuda:
            from torch.multiprocessing import reductions

            _, args = reductions.reduce_tensor(t)
            args = list(args)
            args[0], args[4], args[6] = None, None, gpu_uuid(t.device.index)
            return rebuild_cuda_tensor_by_uuid, tuple(args)
        t = t.cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return rebuild_cpu_tensor, (data, t.dtype, tuple(t.shape))


def serialize(obj: Any, output_str: bool = False) -> bytes | str:
    """Pickle ``obj`` (tensors as above); ``output_str`` base64-encodes for JSON."""
    buf = io.BytesIO()
    _TensorPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    data = buf.getvalue()
    return base64.b64encode(data).decode("ascii") if output_str else data


# ------------------------------------------------------------------ allow-list unpickler
# no ``range``, and ``bytes``/``bytearray`` only over bytes: a global that turns a small number
# into a large object (``list(range(10**9))``, ``bytes(10**12)``) would let a few bytes of
# payload exhaust a rank's memory
_SAFE_BUILTINS = frozenset({"list", "dict", "tuple", "set", "frozenset", "str", "int", "float",
                            "complex", "bool", "slice"})


def _bytes_only(kind: type):
    def build(data: Any = b"", *args: Any) -> Any:
        if not isinstance(data, (bytes, bytearray, str)) or len(args) > 1:
            raise UnsafePayloadError(f"{kind.__name__}() is allowed over bytes only")
        return kind(data, *args) if args else kind(data)
    return build


_THIS = __name__
_ALIASES = {  # SGLang's payload classes -> ours, so its clients work unchanged
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): LocalSerializedTensor,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): rebuild_cuda_tensor_by_uuid,
}
_OURS = {"LocalSerializedTensor": LocalSerializedTensor,
         "FlattenedTensorMetadata": FlattenedTensorMetadata,
         "rebuild_cpu_tensor": rebuild_cpu_tensor,
         "rebuild_cuda_tensor_by_uuid": rebuild_cuda_tensor_by_uuid}
# classes torch's own CUDA reduction names (SGLang clients send them)
_TORCH_CLASSES = {("torch", "Tensor"): torch.Tensor,
                  ("torch", "UntypedStorage"): torch.UntypedStorage,
                  ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
                  ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
                  ("torch", "Size"): torch.Size, ("torch", "device"): torch.device}


class SafeUnpickler(pickle.Unpickler):
    """Resolves only: safe builtins, ``collections.OrderedDict``, torch dtypes, ``torch.Size``,
    ``torch.device``, torch tensor/storage classes, our payload classes and rebuild functions
    (and SGLang's names for them). Everything else raises ``UnsafePayloadError``."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _SAFE_BUILTINS:
            return getattr(__import__("builtins"), name)
        if module == "builtins" and name in ("bytes", "bytearray"):
            return _bytes_only(bytes if name == "bytes" else bytearray)
        if (module, name) == ("collections", "OrderedDict"):
            from collections import OrderedDict
            return OrderedDict
        if module == _THIS and name in _OURS:
            return _OURS[name]
        if (module, name) in _ALIASES:
            return _ALIASES[(module, name)]
        if (module, name) in _TORCH_CLASSES:
            return _TORCH_CLASSES[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePayloadError(f"payload refers to {module}.{name}, which is not allowed")


def deserialize(data: bytes | str) -> Any:
    """Inverse of ``serialize`` through ``SafeUnpickler`` (base64 strings decoded first).
    Raises ``UnsafePayloadError`` for a forbidden global or undecodable data; errors while
    rebuilding a tensor (e.g. a CUDA handle on a machine without that GPU) propagate."""
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise UnsafePayloadError(f"not valid base64: {e}") from None
    if not isinstance(data, (bytes, bytearray)):
        raise UnsafePayloadError(f"expected bytes or a base64 string, got {type(data).__name__}")
    try:
        return SafeUnpickler(io.BytesIO(data)).load()
    except UnsafePayloadError:
        raise
    except (pickle.UnpicklingError, EOFError, IndexError, AttributeError, TypeError) as e:
        raise UnsafePayloadError(f"not a valid payload: {type(e).__name__}: {e}") from None
