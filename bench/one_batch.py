"""One-batch latency (like ``sglang.bench_one_batch``): a static batch of ``bs`` requests,
prefill (input_len tokens each) then greedy decode steps, driven through the real Scheduler and
ModelRunner (flashinfer + CUDA graphs) on a Llama-3.1-8B-shaped model with random bf16 weights.

Printed beside each decode figure: the floor = (weight bytes + KV bytes read per step) / the
device-to-device copy bandwidth measured in the same run (bytes read + written), and HF
transformers ``generate()`` on the same weights.

    python bench/one_batch.py --batch-sizes 1 8 32 128 --input-len 128 --output-len 128 \
        --hf-batch-sizes 1 32

``--tp-size N`` spawns N rank processes that start like the engine's ranks (TCPStore, NCCL +
gloo groups, GPU = rank) and run the same deterministic scheduler over the same requests in
lockstep, so every ``step()`` meets the all-reduces inside the forward on all ranks (the
engine's own TP scheme, minus the broadcast of inputs). Rank 0 times and prints; the floor is
then per GPU (its shard of weights and KV), CUDA graphs are replayed on all ranks together, and
the HF comparison is skipped.

    python bench/one_batch.py --tp-size 2 --hf-batch-sizes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from engine.config import EngineArgs, ModelConfig
from engine.distributed.parallel_state import ParallelState
from engine.io_struct import GenerateReqInput
from engine.runner.model_runner import ModelRunner
from engine.scheduler.scheduler import Scheduler
from engine.types import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ when imported
from tp_ranks import run_ranks  # noqa: E402

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "bos_token_id": 128000, "eos_token_id": 128001}


class NullTokenizer:
    """Enough of a tokenizer for the scheduler's detokenizer: every token decodes to ''."""
    all_special_ids: list[int] = []

    def decode(self, ids, **kw) -> str:
        return ""

    def convert_ids_to_tokens(self, tid) -> str:
        return ""


def copy_bandwidth(device, nbytes: int = 2 * 2**30, iters: int = 20) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * iters / (start.elapsed_time(end) / 1e3)


def run_batch(sched: Scheduler, bs: int, input_len: int, output_len: int, seed: int,
              ps: ParallelState = ParallelState()):
    """Returns (prefill seconds, per-decode-step seconds list). At tp > 1 every rank calls
    this with the same arguments; the barrier lines the ranks up before the clock starts."""
    g = torch.Generator().manual_seed(seed)
    for i in range(bs):
        ids = torch.randint(0, 128000, (input_len,), generator=g).tolist()
        sp = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
        sched.add_request(GenerateReqInput(f"b{bs}-{i}", ids, sp, log_metrics=False))
    torch.cuda.synchronize()
    ps.barrier()
    t0 = time.perf_counter()
    while any(not r.output_ids for r in sched.running) or sched.waiting:
        sched.step()
    torch.cuda.synchronize()  # with overlap the prefill's step is still in flight here
    prefill = time.perf_counter() - t0
    steps = []
    while sched.busy:
        t = time.perf_counter()
        sched.step()  # one host sync: this step's ids (the previous step's, with overlap)
        steps.append(time.perf_counter() - t)
    return prefill, steps


def graph_replay_ms(runner, bs: int, iters: int = 50) -> float:
    """GPU time of one replay of the captured decode graph for ``bs`` (dummy rows, kv_len 1):
    the forward alone, without the scheduler, planning and sampling around it."""
    graph = runner.graph_runner.graphs[bs]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def profile_batch(sched: Scheduler, runner, bs: int, input_len: int, out_dir: str,
                  write: bool = True) -> None:
    """Host profile (cProfile, 32 decode steps) and GPU kernel table (torch.profiler, 10 graph
    replays) for batch ``bs``, appended to ``out_dir/profile.txt``. At tp > 1 every rank runs
    the same steps and replays (collectives inside); only the one with ``write`` writes."""
    import cProfile
    import io
    import pstats
    if write:
        os.makedirs(out_dir, exist_ok=True)
    g = torch.Generator().manual_seed(7)
    for i in range(bs):
        ids = torch.randint(0, 128000, (input_len,), generator=g).tolist()
        sp = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        sched.add_request(GenerateReqInput(f"p{bs}-{i}", ids, sp, log_metrics=False))
    while any(not r.output_ids for r in sched.running) or sched.waiting:
        sched.step()
    for _ in range(4):
        sched.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(32):
        sched.step()
    prof.disable()
    while sched.busy:
        sched.step()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
    if write:
        with open(f"{out_dir}/profile.txt", "a") as f:
            f.write(f"\n==== host cProfile, batch {bs}, 32 decode steps\n{buf.getvalue()}")
    if bs in runner.graph_runner.graphs:
        graph = runner.graph_runner.graphs[bs]
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            for _ in range(10):
                graph.replay()
            torch.cuda.synchronize()
        if not write:
            return
        with open(f"{out_dir}/profile.txt", "a") as f:
            f.write(f"\n==== GPU kernels, batch {bs}, 10 graph replays\n")
            f.write(p.key_averages().table(sort_by="cuda_time_total", row_limit=40,
                                           max_name_column_width=90))


def hf_decode_ms(hf, bs: int, input_len: int, n: int) -> float:
    """HF generate() greedy: (time(n new tokens) - time(1 new token)) / (n - 1), in ms."""
    ids = torch.randint(0, 128000, (bs, input_len), device="cuda")

    def gen(k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    gen(2)
    return (gen(n) - gen(1)) / (n - 1) * 1e3


def bench(a: argparse.Namespace, model_dir: str, ps: ParallelState) -> None:
    """Build this rank's runner and scheduler, run the workload, and (rank 0) print the table.
    At tp > 1 every rank runs this same sequence: each ``step()``, graph replay and profile
    meets the collectives of the other ranks."""
    lead, tp = ps.tp_rank == 0, ps.tp_size
    max_bs = max(a.batch_sizes)
    ctx = a.input_len + a.output_len + 8
    # at tp > 1 the engine gives every rank rank 0's sampler seed (start_scheduler); greedy
    # never draws, but the ranks stay identical either way
    tp_args = {"tp_size": tp, "random_seed": 0} if tp > 1 else {}
    eargs = EngineArgs(model_path=model_dir, device="cuda", load_format="dummy",
                       context_length=ctx, max_total_tokens=max_bs * ctx,
                       max_running_requests=max_bs, cuda_graph_max_bs=max_bs,
                       disable_radix_cache=True, max_prefill_tokens=max_bs * a.input_len,
                       disable_overlap_schedule=a.disable_overlap_schedule, **tp_args)
    mc = ModelConfig.from_path(model_dir)
    t0 = time.perf_counter()
    runner = ModelRunner(eargs, model_dir, mc, ps)
    if lead:
        print(f"model + KV + graphs ready in {time.perf_counter() - t0:.1f} s "
              f"(graph capture {runner.graph_runner.capture_seconds:.1f} s, "
              f"{len(runner.graph_runner.buckets)} sizes)", flush=True)
    sched = Scheduler(eargs, runner, NullTokenizer(), mc)

    hf = None
    if a.hf_batch_sizes and tp == 1:
        from transformers import AutoModelForCausalLM, LlamaConfig
        cfg = {k: v for k, v in LLAMA_8B.items() if k != "architectures"}
        with torch.device("cuda"):
            hf = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=torch.bfloat16)
        hf.eval().generation_config.eos_token_id = None
        runner.model.load_weights((n, p.data) for n, p in hf.named_parameters())  # same weights

    bw = copy_bandwidth(runner.device) if lead else float("nan")
    # this rank's shard at tp > 1 (embedding, lm_head, attention and MLP split tp ways; the
    # norms are replicated) and its KV heads' bytes per token
    w_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_tok = runner._kv_bytes(1) // runner.page_size
    run_batch(sched, max_bs, a.input_len, 4, seed=99, ps=ps)  # warm-up (prefill shapes, sampler)
    rows = []
    for bs in a.batch_sizes:
        prefill, steps = run_batch(sched, bs, a.input_len, a.output_len, seed=bs, ps=ps)
        ms = statistics.median(steps) * 1e3
        mean_ms = statistics.mean(steps) * 1e3
        kv_read = bs * (a.input_len + a.output_len / 2) * kv_tok
        floor = (w_bytes + kv_read) / bw * 1e3
        ps.barrier()  # at tp > 1 all ranks replay together (the all-reduces are in the graph)
        replay = graph_replay_ms(runner, bs) if bs in runner.graph_runner.graphs else float("nan")
        rows.append((bs, prefill * 1e3, ms, mean_ms, bs / ms * 1e3, floor, floor / ms, replay))
        if a.profile_dir:
            profile_batch(sched, runner, bs, a.input_len, a.profile_dir, write=lead)
    if not lead:
        return
    hf_ms = {}
    if hf is not None:
        with torch.inference_mode():
            for bs in a.hf_batch_sizes:
                hf_ms[bs] = hf_decode_ms(hf, bs, a.input_len, a.hf_output_len)
    dev = torch.cuda.get_device_name()
    if tp == 1:
        print(f"\n{dev}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s "
              f"(read+write), weights {w_bytes / 1e9:.2f} GB, KV {kv_tok} B/token; input "
              f"{a.input_len}, output {a.output_len}; overlap schedule "
              f"{'off' if a.disable_overlap_schedule else 'on'}\n")
    else:
        print(f"\n{tp} x {dev}, tp {tp} (NCCL), torch {torch.__version__}, copy bandwidth "
              f"{bw / 1e12:.2f} TB/s of one GPU (read+write), weights {w_bytes / 1e9:.2f} GB "
              f"per GPU, KV {kv_tok} B/token per GPU; input {a.input_len}, output "
              f"{a.output_len}\nfloor at tp {tp}: (this GPU's weight shard + its KV heads' bytes "
              f"read per step) / one GPU's copy bandwidth, about (weights/{tp} + KV read/{tp}) / "
              f"bandwidth: each GPU reads only its shard (all-reduce time is not in the floor). "
              f"graph replay ms: all {tp} ranks replay their graphs in lockstep. HF generate: "
              f"skipped at tp > 1.\n")
    hf_head = " HF generate ms/step | HF tok/s |" if tp == 1 else ""
    print("| batch | prefill ms | decode ms/step (median) | mean | tok/s | floor ms/step | "
          "% of floor | graph replay ms |" + hf_head)
    print("|" + "---|" * (10 if tp == 1 else 8))
    for bs, pre, ms, mean_ms, tps, floor, frac, replay in rows:
        h = hf_ms.get(bs)
        hf_cols = f" {h:.1f} | {bs / h * 1e3:.0f} |" if h else " - | - |"
        print(f"| {bs} | {pre:.1f} | {ms:.2f} | {mean_ms:.2f} | {tps:.0f} | {floor:.2f} | "
              f"{frac * 100:.0f}% | {replay:.2f} |" + (hf_cols if tp == 1 else ""))
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="*", default=[1, 32],
                    help="batch sizes for HF generate() (skipped at --tp-size > 1)")
    ap.add_argument("--hf-output-len", type=int, default=32)
    ap.add_argument("--profile-dir", default=None,
                    help="write a host cProfile of decode steps and a per-kernel GPU time "
                         "table of one graph replay, per batch size, into this folder "
                         "(rank 0's at --tp-size > 1)")
    ap.add_argument("--disable-overlap-schedule", action="store_true",
                    help="finish each step before launching the next (the engine's flag)")
    ap.add_argument("--tp-size", type=int, default=1,
                    help="tensor parallel ranks, one process and one GPU each (GPUs 0..N-1)")
    a = ap.parse_args()
    if a.tp_size < 1:
        ap.error("--tp-size must be at least 1")
    d = tempfile.mkdtemp()
    with open(f"{d}/config.json", "w") as f:
        json.dump(LLAMA_8B, f)
    if a.tp_size == 1:
        bench(a, d, ParallelState())
        return
    if torch.cuda.device_count() < a.tp_size:
        ap.error(f"--tp-size {a.tp_size} needs {a.tp_size} GPUs, {torch.cuda.device_count()} "
                 "visible")
    run_ranks(bench, a.tp_size, (a, d))


if __name__ == "__main__":
    main()
