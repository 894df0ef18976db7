"""Weight updates at tp=2 (two engine ranks over gloo, CPU): every rank opens the entry and
the ``LocalSerializedTensor`` value of its deployment ``tp_rank``, keeps its own shard, and
after an update to checkpoint B answers like a fresh engine from B (tp=2 == tp=1 in float32).
"""

from __future__ import annotations

import httpx
import pytest
import torch

from harness import STORIES, free_port
from engine.engine import Engine
from engine.weights.loader import iter_weights
from engine.weights.trainer_client import TrainerClient, local_serialized, tensor_payloads
from tests.weight_ckpt import make_checkpoint_b

PROMPTS = [[1, 403, 407, 261, 378], [1, 334, 300, 450]]
NEW = 10
NORM = "model.layers.0.input_layernorm.weight"  # replicated: each rank keeps the full (64,)
UP = "model.layers.2.mlp.up_proj.weight"  # column-parallel: rank r keeps rows [86r, 86r + 86)


@pytest.fixture(scope="module")
def client(launch):
    srv = launch(["--model-path", STORIES, "--tp-size", "2"])
    c = TrainerClient(srv.url)
    c.url = srv.url
    yield c
    c.close()


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory):
    return make_checkpoint_b(STORIES, str(tmp_path_factory.mktemp("ckpt") / "stories_b"))


def _greedy(eng: Engine) -> list[list[int]]:
    sp = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    return [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=sp)]


def _outputs(client) -> list[list[int]]:
    return [r["output_ids"] for r in client.generate(PROMPTS, NEW)]


def test_per_rank_entries_reach_their_deployment_rank(client):
    assert client.tp_size == 2
    entries = [[(NORM, torch.full((64,), float(i + 1)))] for i in range(2)]
    assert client.update_weights_from_tensor(entries)["success"]
    for i in range(2):
        assert client.get_weights_by_name(NORM, 3, tp_rank=i) == [i + 1.0] * 3


def test_local_serialized_tensor_values_reach_their_deployment_rank(client):
    lst = local_serialized([torch.full((64,), 3.0), torch.full((64,), 4.0)])
    assert client.update_weights_from_tensor([(NORM, lst)])["success"]
    assert client.get_weights_by_name(NORM, 2, tp_rank=0) == [3.0, 3.0]
    assert client.get_weights_by_name(NORM, 2, tp_rank=1) == [4.0, 4.0]


def test_full_tensor_is_sharded_by_each_rank(client):
    rows = torch.arange(172, dtype=torch.float32)[:, None].expand(172, 64).contiguous()
    assert client.update_weights_from_tensor([(UP, rows)])["success"]
    assert client.get_weights_by_name(UP, 1, tp_rank=0)[0][0] == 0.0
    assert client.get_weights_by_name(UP, 1, tp_rank=1)[0][0] == 86.0


def test_wrong_entry_count_is_400_and_changes_nothing(client):
    before = client.get_weights_by_name(NORM, 2, tp_rank=1)
    body = {"serialized_named_tensors": tensor_payloads([(NORM, torch.zeros(64))], 1)}
    r = httpx.post(client.url + "/update_weights_from_tensor", json=body, timeout=60)
    assert r.status_code == 400 and "one entry per TP rank" in r.json()["message"]
    bad_rank1 = [[(NORM, torch.zeros(64))], [(NORM, torch.zeros(65))]]  # only rank 1 is bad
    r = client.update_weights_from_tensor(bad_rank1, check=False)
    assert not r["success"]
    assert client.get_weights_by_name(NORM, 2, tp_rank=0) == [3.0, 3.0]  # rank 0 unchanged
    assert client.get_weights_by_name(NORM, 2, tp_rank=1) == before


def test_tensor_disk_and_gloo_updates_match_fresh_b(client, ckpt_b):
    ref_b = _greedy(Engine(model_path=ckpt_b))
    ref_a = _greedy(Engine(model_path=STORIES))
    named_b = list(iter_weights(ckpt_b, "auto"))
    r = client.update_weights_from_tensor(named_b, weight_version="tp2-B")
    assert r["success"], r
    assert _outputs(client) == ref_b
    assert client.update_weights_from_disk(STORIES)["success"]
    assert _outputs(client) == ref_a
    group = client.init_weights_update_group("127.0.0.1", free_port(), world_size=3,
                                             backend="gloo", group_name="tp2")
    try:
        r = client.update_weights_from_distributed(group, named_b, load_format="flattened_bucket",
                                                   weight_version="tp2-gloo")
        assert r["success"], r
        assert _outputs(client) == ref_b
        assert client.weight_version() == "tp2-gloo"
    finally:
        client.destroy_weights_update_group(group)
