"""CUDA IPC weight updates through HTTP (colocated trainer and server on one GPU).

The trainer (this process) makes CUDA tensors; ``update_weights_from_tensor`` sends their IPC
handles tagged with the GPU UUID; the server opens them on its own GPU, copies, closes. Checks:
plain, flattened_bucket and LocalSerializedTensor payloads land; repeated updates leak no memory
on the trainer side (sglang-facts.md section 7.1); a CPU payload still works on a GPU server.

    python -m pytest -q tests/gpu/test_weight_ipc.py
"""

import pytest
import torch

from engine.weights import serialization as ser
from engine.weights.trainer_client import TrainerClient, local_serialized
from tests.conftest import STORIES
from tests.e2e.harness import ServerProcess

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

UP = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(5)]


@pytest.fixture(scope="module")
def client():
    srv = ServerProcess(["--model-path", STORIES, "--device", "cuda", "--dtype", "float32",
                         "--mem-fraction-static", "0.3"])
    try:
        srv.wait_ready()
        c = TrainerClient(srv.url)
        yield c
        c.close()
    finally:
        srv.kill()


def test_payload_names_the_gpu_by_uuid():
    t = torch.ones(4, device="cuda")
    assert ser.gpu_uuid(0).encode() in ser.serialize([("x", t)])


def test_cuda_tensors_update_through_ipc(client):
    named = [(n, torch.full((172, 64), 1.5, device="cuda")) for n in UP[:3]]
    assert client.update_weights_from_tensor(named)["success"]
    for n in UP[:3]:
        assert client.get_weights_by_name(n, 1)[0][:4] == [1.5] * 4


def test_flattened_bucket_over_one_ipc_handle(client):
    named = [(n, torch.full((172, 64), 2.0, device="cuda")) for n in UP[:4]]
    r = client.update_weights_from_tensor(named, load_format="flattened_bucket")
    assert r["success"], r
    assert all(client.get_weights_by_name(n, 1)[0][0] == 2.0 for n in UP[:4])


def test_local_serialized_tensor_and_cpu_payload_on_gpu_server(client):
    lst = local_serialized([torch.full((172, 64), 3.0, device="cuda")])
    assert client.update_weights_from_tensor([(UP[4], lst)])["success"]
    assert client.get_weights_by_name(UP[4], 1)[0][0] == 3.0
    assert client.update_weights_from_tensor([(UP[4], torch.full((172, 64), 4.0))])["success"]
    assert client.get_weights_by_name(UP[4], 1)[0][0] == 4.0


def test_repeated_ipc_updates_do_not_leak_trainer_memory(client):
    def once():
        named = [(n, torch.full((172, 64), 0.5, device="cuda")) for n in UP]
        assert client.update_weights_from_tensor(named)["success"]
        del named
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()

    once()
    before = torch.cuda.memory_allocated()
    for _ in range(20):
        once()
    assert torch.cuda.memory_allocated() - before <= 1024
