"""Weight updates on a tiny Qwen3 (per-head q/k norm, one KV head, untied head): after an
update to checkpoint B by tensor and by the gloo process group, greedy outputs equal those of a
fresh engine from B. The tiny model has no tokenizer: stories260K's is borrowed, prompts are
token ids below its 128-token vocabulary and the server warm-up (text) is skipped."""

from __future__ import annotations

import pytest

from harness import STORIES, free_port
from engine.engine import Engine
from engine.weights.loader import iter_weights
from engine.weights.trainer_client import TrainerClient
from tests.weight_ckpt import make_checkpoint_b

PROMPTS = [[1, 40, 17, 99], [1, 5, 6, 7, 8, 9]]
NEW = 8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tests.model.tiny_models import make_tiny

    root = tmp_path_factory.mktemp("qwen3")
    a = make_tiny("qwen3", str(root))
    return a, make_checkpoint_b(a, str(root / "qwen3_b"), scale=0.3)


@pytest.fixture(scope="module")
def client(launch, ckpts):
    srv = launch(["--model-path", ckpts[0], "--tokenizer-path", STORIES,
                  "--skip-server-warmup", "--weight-version", "A"])
    c = TrainerClient(srv.url)
    c.url = srv.url
    yield c
    c.close()


def _greedy(path: str) -> list[list[int]]:
    eng = Engine(model_path=path, tokenizer_path=STORIES)
    sp = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    return [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=sp)]


def test_qwen3_tensor_and_gloo_updates_match_fresh_b(client, ckpts):
    a, b = ckpts
    ref_a, ref_b = _greedy(a), _greedy(b)
    assert ref_a != ref_b
    out = client.generate(PROMPTS, NEW)
    assert [o["output_ids"] for o in out] == ref_a
    assert client.update_weights_from_tensor(list(iter_weights(b, "auto")),
                                             weight_version="qB")["success"]
    out = client.generate(PROMPTS, NEW)
    assert [o["output_ids"] for o in out] == ref_b
    assert {o["meta_info"]["weight_version"] for o in out} == {"qB"}
    group = client.init_weights_update_group("127.0.0.1", free_port(), world_size=2,
                                             backend="gloo")
    try:
        r = client.update_weights_from_distributed(group, list(iter_weights(a, "auto")))
        assert r["success"], r
        assert [o["output_ids"] for o in client.generate(PROMPTS, NEW)] == ref_a
    finally:
        client.destroy_weights_update_group(group)
