"""``WeightUpdater`` and the scheduler's pause modes, in process on stories260K (CPU, tp=1)."""

import threading

import pytest
import torch
from safetensors import safe_open

from engine.config import EngineArgs
from engine.distributed.parallel_state import ParallelState
from engine.engine import create_scheduler
from engine.io_struct import GenerateReqInput
from engine.types import SamplingParams
from engine.weights import serialization as ser
from engine.weights.update_group import join_update_group
from tests.conftest import STORIES

K = "model.layers.3.self_attn.k_proj.weight"
UP = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def sched():
    return create_scheduler(EngineArgs(model_path=STORIES, device="cpu"), ParallelState())


def _hf(name):
    with safe_open(f"{STORIES}/model.safetensors", "pt") as f:
        return f.get_tensor(name).float()


def _snapshot(s):
    return {k: v.detach().clone() for k, v in s.runner.model.named_parameters()}


def test_get_weights_by_name_reads_hf_views_of_fused_params(sched):
    got = torch.tensor(sched.weights.get_weights_by_name(K, truncate_size=5))
    assert torch.equal(got, _hf(K)[:5])
    assert torch.equal(torch.tensor(sched.weights.get_weights_by_name(UP, 3)), _hf(UP)[:3])
    assert sched.weights.get_weights_by_name(K, tp_rank=1) is None  # another rank's answer
    with pytest.raises(KeyError):
        sched.weights.get_weights_by_name("model.layers.99.mlp.up_proj.weight")


def test_update_copies_and_a_bad_tensor_anywhere_changes_nothing(sched):
    w = sched.weights
    ok, msg = w.update_weights_from_tensor([ser.serialize([(UP, torch.full((172, 64), 1.5))])],
                                           weight_version="v2")
    assert ok and "Weight version updated to v2" in msg and sched.weight_version == "v2"
    assert w.get_weights_by_name(UP, 1)[0][:3] == [1.5] * 3
    before = _snapshot(sched)
    cases = {"shape (64, 172)": [(K, torch.zeros(32, 64)), (UP, torch.zeros(64, 172))],
             "unknown weight": [(K, torch.zeros(32, 64)), ("model.foo.weight", torch.zeros(2))],
             "not a floating-point": [(K, torch.zeros(32, 64, dtype=torch.int32))],
             "expected a tensor": [(K, "zeros")]}
    for why, named in cases.items():
        ok, msg = w.update_weights_from_tensor([ser.serialize(named)])
        assert not ok and why in msg and "No weights were changed" in msg, msg
    after = _snapshot(sched)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_direct_format_takes_fused_names_and_shard_shapes(sched):
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    ok, _ = sched.weights.update_weights_from_tensor(
        [ser.serialize([(qkv, torch.full((128, 64), 2.0))])], load_format="direct")
    assert ok
    assert sched.weights.get_weights_by_name("model.layers.0.self_attn.v_proj.weight",
                                             1)[0][0] == 2.0
    ok, msg = sched.weights.update_weights_from_tensor(
        [ser.serialize([(qkv, torch.zeros(64, 64))])], load_format="direct")
    assert not ok and "shape" in msg


def test_disk_update_rejects_a_different_architecture(sched, tmp_path):
    import json
    import shutil
    shutil.copytree(STORIES, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    ok, msg, _ = sched.weights.update_weights_from_disk(str(tmp_path / "m"))
    assert not ok and "num_hidden_layers" in msg
    ok, msg, data = sched.weights.update_weights_from_disk(STORIES, weight_version="disk")
    assert ok and data == {"num_paused_requests": 0}, msg
    assert torch.equal(torch.tensor(sched.weights.get_weights_by_name(UP, 2)), _hf(UP)[:2])


@pytest.mark.parametrize("drop", ["model.layers.2.self_attn.k_proj.weight",
                                  "model.layers.1.mlp.up_proj.weight"])
def test_disk_update_missing_one_part_of_a_fused_weight_changes_nothing(sched, tmp_path, drop):
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(STORIES, tmp_path / "m")
    sd = load_file(str(tmp_path / "m" / "model.safetensors"))
    del sd[drop]
    save_file({k: v * 2 for k, v in sd.items()}, str(tmp_path / "m" / "model.safetensors"))
    before = _snapshot(sched)
    ok, msg, _ = sched.weights.update_weights_from_disk(str(tmp_path / "m"))
    fused = drop.replace("k_proj", "qkv_proj").replace("up_proj", "gate_up_proj")
    assert not ok and f"no weights for {fused}" in msg, msg
    assert all(torch.equal(v, before[k]) for k, v in _snapshot(sched).items())


def test_disk_update_rejects_an_unknown_load_format(sched):
    ok, msg, _ = sched.weights.update_weights_from_disk(STORIES, load_format="xx")
    assert not ok and "load_format" in msg


@pytest.mark.parametrize("offset,world", [(0, 2), (1, 1), (-1, 2), (2, 2)])
def test_update_group_sizes_that_cannot_work_are_refused_at_once(sched, offset, world):
    ok, msg = sched.weights.init_weights_update_group("127.0.0.1", 1, offset, world, "bad")
    assert not ok and "rank_offset" in msg and "bad" not in sched.weights.groups


def test_distributed_update_refuses_negative_shapes(sched):
    sched.weights.groups["neg"] = object()  # never reached: the shapes fail first
    try:
        ok, msg = sched.weights.update_weights_from_distributed(
            [UP], ["float32"], [[-1, 64]], group_name="neg")
    finally:
        del sched.weights.groups["neg"]
    assert not ok and "non-negative" in msg


def test_distributed_update_over_a_private_gloo_group(sched):
    port = __import__("socket").socket()
    port.bind(("127.0.0.1", 0))
    addr = port.getsockname()[1]
    port.close()
    trainer = {}
    t = threading.Thread(target=lambda: trainer.setdefault("g", join_update_group(
        "127.0.0.1", addr, 0, 2, "g", "gloo", torch.device("cpu"))))
    t.start()
    ok, msg = sched.weights.init_weights_update_group("127.0.0.1", addr, 1, 2, "g", "gloo")
    t.join()
    assert ok, msg
    value = torch.full((172, 64), 0.25)
    t = threading.Thread(target=lambda: trainer["g"].broadcast([value]))
    t.start()
    ok, msg = sched.weights.update_weights_from_distributed([UP], ["float32"], [[172, 64]], "g")
    t.join()
    assert ok, msg
    assert sched.weights.get_weights_by_name(UP, 1)[0][0] == 0.25
    assert sched.weights.destroy_weights_update_group("g")[0]
    trainer["g"].destroy()


def _start(s, n, max_new=30):
    for i in range(n):
        s.add_request(GenerateReqInput(f"r{i}", [300 + i, 261, 378],
                                       SamplingParams(max_new_tokens=max_new, temperature=0,
                                                      ignore_eos=True)))
    for _ in range(3):
        s.step()


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_pause_modes(sched, mode):
    _start(sched, 4)
    assert len(sched.running) == 4
    assert sched.pause_generation(mode)[0] and sched.can_update_weights
    outs = sched.step()
    if mode == "abort":
        assert {o.finish_reason["type"] for o in outs} == {"abort"} and not sched.busy
    else:
        assert outs == []  # no forward step while paused
        assert len(sched.running) == (4 if mode == "in_place" else 0)
        assert all(r.req_pool_idx is None for r in sched.waiting)
    sched.continue_generation()
    done = []
    while sched.busy:
        done += [o for o in sched.step() if o.finished]
    assert all(o.finish_reason["type"] == "length" for o in done)
    assert len(done) == (0 if mode == "abort" else 4)
