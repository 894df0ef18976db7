"""Weight updates against a real stories260K server (tp=1, CPU, float32).

Reference outputs for checkpoint B (a perturbed copy of stories260K) come from an in-process
``Engine`` started from B: the same engine code a fresh server from B runs. Tests run in file
order on one server; each leaves the server on checkpoint A unless it says otherwise.
"""

from __future__ import annotations

import json
import pickle
import threading
import time

import httpx
import pytest
import torch

from harness import STORIES, free_port
from engine.engine import Engine
from engine.weights import serialization as ser
from engine.weights.loader import iter_weights
from engine.weights.trainer_client import TrainerClient, tensor_payloads
from tests.weight_ckpt import make_checkpoint_b

PROMPTS = [[1, 403, 407, 261, 378], [1, 334, 300, 450], [1, 68, 77, 99, 120, 260]]
NEW = 12
PROBE = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory):
    return make_checkpoint_b(STORIES, str(tmp_path_factory.mktemp("ckpt") / "stories_b"))


@pytest.fixture(scope="module")
def server(launch):
    return launch(["--model-path", STORIES, "--max-running-requests", "16",
                   "--weight-version", "A"], wait=False)


@pytest.fixture(scope="module")
def client(server):
    server.wait_ready()
    c = TrainerClient(server.url)
    yield c
    c.close()


def greedy(eng: Engine, prompts: list[list[int]], max_new: int | list[int]) -> list[list[int]]:
    news = max_new if isinstance(max_new, list) else [max_new] * len(prompts)
    sp = [{"temperature": 0, "max_new_tokens": m, "ignore_eos": True} for m in news]
    return [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)]


@pytest.fixture(scope="module")
def engines(ckpt_b):
    """In-process engines on A and on B: what fresh servers from A and B would answer."""
    return {"A": Engine(model_path=STORIES), "B": Engine(model_path=ckpt_b)}


@pytest.fixture(scope="module")
def refs(engines):
    return {k: greedy(e, PROMPTS, NEW) for k, e in engines.items()}


def _outputs(client) -> tuple[list[list[int]], set[str]]:
    res = client.generate(PROMPTS, NEW)
    return [r["output_ids"] for r in res], {r["meta_info"]["weight_version"] for r in res}


def _versions(server) -> tuple[str, str]:
    info = httpx.get(server.url + "/model_info").json()
    return info["weight_version"], httpx.get(server.url + "/weight_version").json()[
        "weight_version"]


def _named(path: str):
    return list(iter_weights(path, "auto"))


def test_tensor_update_to_b_matches_fresh_b_and_sets_version(server, client, refs, ckpt_b):
    assert refs["A"] != refs["B"]
    assert _outputs(client) == (refs["A"], {"A"})
    r = client.update_weights_from_tensor(_named(ckpt_b), weight_version="B1")
    assert r["success"] and "Weight version updated to B1" in r["message"]
    assert _outputs(client) == (refs["B"], {"B1"})
    assert _versions(server) == ("B1", "B1")
    # back to A through a flattened bucket
    r = client.update_weights_from_tensor(_named(STORIES), load_format="flattened_bucket",
                                          weight_version="A2")
    assert r["success"], r
    assert _outputs(client) == (refs["A"], {"A2"})


def test_disk_update_changes_model_path_and_bad_path_keeps_weights(server, client, refs, ckpt_b):
    r = client.update_weights_from_disk(ckpt_b, weight_version="disk-B")
    assert r["success"] and r["num_paused_requests"] == 0, r
    assert _outputs(client) == (refs["B"], {"disk-B"})
    assert httpx.get(server.url + "/model_info").json()["model_path"] == ckpt_b
    r = client.update_weights_from_disk("/nonexistent/ckpt", check=False)
    assert not r["success"] and "/nonexistent/ckpt" in r["message"]
    assert _outputs(client)[0] == refs["B"]
    assert httpx.get(server.url + "/model_info").json()["model_path"] == ckpt_b
    assert client.update_weights_from_disk(STORIES, weight_version="A3")["success"]
    assert _outputs(client) == (refs["A"], {"A3"})


def test_distributed_gloo_update_matches_fresh_b(server, client, refs, ckpt_b):
    group = client.init_weights_update_group("127.0.0.1", free_port(), world_size=2,
                                             backend="gloo", group_name="g1")
    try:
        r = client.update_weights_from_distributed(group, _named(ckpt_b), weight_version="nccl-B")
        assert r["success"], r
        assert _outputs(client) == (refs["B"], {"nccl-B"})
        r = client.update_weights_from_distributed(group, _named(STORIES),
                                                   load_format="flattened_bucket")
        assert r["success"], r
        assert _outputs(client)[0] == refs["A"]
    finally:
        assert client.destroy_weights_update_group(group)["success"]


class _Evil:
    def __reduce__(self):
        import os
        return (os.system, ("echo pwned > /tmp/eyrie_pwned",))


def test_bad_payloads_get_400_and_change_nothing(server, client, refs):
    before = client.get_weights_by_name(PROBE, 4)
    full = torch.ones(172, 64)
    bad_bodies = {
        "wrong shape": tensor_payloads([(PROBE, torch.ones(64, 172))], 1),
        "unknown name": tensor_payloads([(PROBE, full), ("model.layers.9.mlp.up_proj.weight",
                                                         full)], 1),
        "list length": tensor_payloads([(PROBE, full)], 2),
        "imports os": [__import__("base64").b64encode(pickle.dumps([(PROBE, _Evil())])).decode()],
        "integer dtype": tensor_payloads([(PROBE, full.long())], 1),
        "bad local list": tensor_payloads([(PROBE, ser.LocalSerializedTensor([]))], 1),
    }
    for why, entries in bad_bodies.items():
        r = httpx.post(server.url + "/update_weights_from_tensor",
                       json={"serialized_named_tensors": entries}, timeout=60)
        assert r.status_code == 400, (why, r.text)
        assert r.json()["success"] is False
    r = httpx.post(server.url + "/update_weights_from_tensor",
                   json={"serialized_named_tensors": "nope"}, timeout=60)
    assert r.status_code == 400
    assert client.get_weights_by_name(PROBE, 4) == before
    assert _outputs(client)[0] == refs["A"]
    assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200
    import os
    assert not os.path.exists("/tmp/eyrie_pwned")


def _stream(url: str, ids: list[int], max_new: int, sink: list, idx: int) -> None:
    body = {"input_ids": ids, "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}
    with httpx.stream("POST", url + "/generate", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                sink[idx] = json.loads(line[6:])


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_update_continue_with_32_streams(server, client, engines, ckpt_b, mode):
    n, max_new = 32, 16
    prompts = [[300 + i, 261, 378] for i in range(n)]  # no shared prefix: no stale KV hits
    last: list = [None] * n
    threads = [threading.Thread(target=_stream, args=(server.url, prompts[i], max_new, last, i))
               for i in range(n)]
    for t in threads:
        t.start()
    t0 = time.time()
    while sum(1 for x in last if x and x["output_ids"]) < 4:
        assert time.time() - t0 < 60
        time.sleep(0.02)
    client.pause_generation(mode)
    time.sleep(0.5)  # outputs sent before the pause reach the streams
    snap = [list(x["output_ids"]) if x else [] for x in last]
    time.sleep(0.5)
    assert [list(x["output_ids"]) if x else [] for x in last] == snap  # nothing runs paused
    r = client.update_weights_from_tensor(_named(ckpt_b), flush_cache=(mode == "retract"),
                                          weight_version=f"paused-{mode}")
    assert r["success"], r
    client.continue_generation()
    for t in threads:
        t.join(timeout=120)
    fins = [x["meta_info"]["finish_reason"] for x in last]
    assert all(f["type"] == "length" for f in fins), fins
    assert all(len(x["output_ids"]) == max_new for x in last)
    # every request unfinished at the pause finished under the new version (under load a
    # fast one may have finished before the pause took effect)
    assert all(last[i]["meta_info"]["weight_version"] == f"paused-{mode}"
               for i in range(n) if len(snap[i]) < max_new)
    resumed = [i for i in range(n) if 0 < len(snap[i]) < max_new]
    assert resumed
    if mode == "retract":  # KV recomputed with B: exactly B's continuation of the prefix
        ref = greedy(engines["B"], [prompts[i] + snap[i] for i in resumed],
                     [max_new - len(snap[i]) for i in resumed])
        for i, o in zip(resumed, ref):
            assert last[i]["output_ids"] == snap[i] + o, i
    # requests that had not started yet ran entirely on B
    fresh = [i for i in range(n) if not snap[i]]
    if fresh:
        ref = greedy(engines["B"], [prompts[i] for i in fresh], max_new)
        assert [last[i]["output_ids"] for i in fresh] == ref
    assert client.update_weights_from_tensor(_named(STORIES), weight_version="A")["success"]


def test_update_without_pause_waits_for_running_requests(server, client, engines, refs,
                                                        ckpt_b):
    out: list = [None]
    t = threading.Thread(target=_stream, args=(server.url, PROMPTS[0], 60, out, 0))
    t.start()
    while out[0] is None:
        time.sleep(0.01)
    r = client.update_weights_from_tensor(_named(ckpt_b), weight_version="B-wait")
    t.join(timeout=60)
    assert r["success"]
    assert out[0]["meta_info"]["weight_version"] == "A"  # finished before the update ran
    assert out[0]["output_ids"] == greedy(engines["A"], [PROMPTS[0]], 60)[0]
    assert _outputs(client) == (refs["B"], {"B-wait"})
    assert client.update_weights_from_tensor(_named(STORIES), weight_version="A")["success"]


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_50_updates_do_not_grow_memory(server, client, ckpt_b):
    engine_pid = server.engine_pid()
    payloads = [_named(STORIES), _named(ckpt_b)]
    for i in range(5):
        assert client.update_weights_from_tensor(payloads[i % 2])["success"]
    base = (_rss_kb(engine_pid), _rss_kb(server.proc.pid))
    for i in range(50):
        assert client.update_weights_from_tensor(payloads[i % 2])["success"]
    grown = (_rss_kb(engine_pid) - base[0], _rss_kb(server.proc.pid) - base[1])
    assert grown[0] < 16 * 1024 and grown[1] < 16 * 1024, grown  # KiB
    assert client.update_weights_from_tensor(_named(STORIES), weight_version="A")["success"]


def test_update_weight_version_shows_everywhere(server, client):
    r = httpx.post(server.url + "/update_weight_version", json={"new_version": "v-manual"})
    assert r.status_code == 200 and r.json()["new_version"] == "v-manual"
    assert _versions(server) == ("v-manual", "v-manual")
    assert _outputs(client)[1] == {"v-manual"}


def test_rl_loop_example_passes_against_the_server(server):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "examples/rl_loop.py", "--url", server.url,
                        "--model-path", STORIES, "--steps", "2", "--path", "distributed"],
                       capture_output=True, text=True, timeout=300, cwd=str(
                           __import__("pathlib").Path(__file__).resolve().parents[2]))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout
