"""Payload format and the allow-list unpickler (engine/weights/serialization.py)."""

import base64
import io
import pickle

import pytest
import torch

from engine.weights import serialization as ser


def test_cpu_tensors_round_trip_by_value_with_dtypes_and_shapes():
    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)),
             ("c", torch.empty(0, 2)), ("d", torch.randn(4, 6)[:, ::2])]  # non-contiguous
    out = ser.deserialize(ser.serialize(named, output_str=True))
    for (n0, t0), (n1, t1) in zip(named, out):
        assert n0 == n1 and t0.dtype == t1.dtype and torch.equal(t0, t1)


def test_local_serialized_tensor_gives_each_rank_its_value():
    lst = ser.LocalSerializedTensor([ser.serialize(torch.full((2,), float(r))) for r in range(3)])
    back = ser.deserialize(ser.serialize([("w", lst)]))[0][1]
    assert [back.get(r).tolist() for r in range(3)] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    with pytest.raises(ValueError, match="none for tp_rank 3"):
        back.get(3)


def test_flattened_bucket_round_trip_mixed_dtypes_and_misaligned_offsets():
    named = [("x", torch.randn(3).to(torch.bfloat16)), ("y", torch.randn(2, 3)),
             ("z", torch.arange(5, dtype=torch.float16))]
    bucket = ser.FlattenedTensorBucket.from_named_tensors(named)
    assert bucket.flattened_tensor.dtype == torch.uint8 and bucket.flattened_tensor.numel() == 40
    payload = ser.deserialize(ser.serialize(bucket.to_payload()))
    got = ser.FlattenedTensorBucket(payload["flattened_tensor"], payload["metadata"])
    for (n0, t0), (n1, t1) in zip(named, got.reconstruct_tensors()):
        assert n0 == n1 and torch.equal(t0, t1)


def test_bucket_metadata_that_overruns_the_buffer_is_rejected():
    bucket = ser.FlattenedTensorBucket.from_named_tensors([("y", torch.randn(4))])
    bucket.metadata[0].end_idx = 400
    with pytest.raises(ValueError, match="does not fit"):
        bucket.reconstruct_tensors()


class _System:
    def __reduce__(self):
        import os
        return (os.system, ("true",))


@pytest.mark.parametrize("payload", [
    pickle.dumps([("w", _System())]),
    pickle.dumps(torch.ones(2)),  # torch's own reduction goes through torch._utils / torch.load
    pickle.dumps(__import__("subprocess").Popen),
    pickle.dumps(getattr),
])
def test_forbidden_globals_raise_unsafe_payload(payload):
    with pytest.raises(ser.UnsafePayloadError, match="not allowed"):
        ser.deserialize(payload)


class _Amplify:
    """A few bytes of pickle that would build a huge object: ``cls(arg)``."""

    def __init__(self, cls, arg):
        self.cls, self.arg = cls, arg

    def __reduce__(self):
        return (self.cls, (self.arg,))


@pytest.mark.parametrize("payload,match", [
    (pickle.dumps(_Amplify(list, range(10))), "builtins.range"),
    (pickle.dumps(_Amplify(bytes, 10**12)), "over bytes only"),
    (pickle.dumps(_Amplify(bytearray, 10**12)), "over bytes only"),
])
def test_memory_bombs_are_refused(payload, match):
    with pytest.raises(ser.UnsafePayloadError, match=match):
        ser.deserialize(payload)


def test_bytes_globals_still_rebuild_bytes():
    assert ser.deserialize(pickle.dumps(_Amplify(bytearray, b"xy"))) == bytearray(b"xy")


def test_garbage_and_bad_base64_raise_unsafe_payload():
    with pytest.raises(ser.UnsafePayloadError):
        ser.deserialize("***not base64***")
    with pytest.raises(ser.UnsafePayloadError):
        ser.deserialize(base64.b64encode(b"\x80\x05garbage").decode())


def test_sglang_class_names_map_to_ours():
    class Fake(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, ser.LocalSerializedTensor):
                return (ser.LocalSerializedTensor, (obj.values,))
            return NotImplemented

    buf = io.BytesIO()
    Fake(buf, protocol=3).dump(ser.LocalSerializedTensor([b"x"]))  # text GLOBAL opcodes
    data = buf.getvalue().replace(b"engine.weights.serialization",
                                  b"sglang.srt.model_executor.model_runner")
    assert isinstance(ser.deserialize(data), ser.LocalSerializedTensor)
