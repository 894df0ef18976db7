"""Serving sweep with start-up timings: launch ``python -m server`` with the given flags, time
launch -> first 200 from ``/health_generate`` ("launch to ready"), read the weight-load and
CUDA-graph capture times from its log, run ``bench/serving.py``'s concurrency sweep against it,
stop it (the whole process group) and append a dated markdown section to ``--output``. The
section is written as it goes (start-up table at ready, one sweep row per level), so a run cut
short still leaves what it measured.

    python bench/serving_sweep.py --label smollm2-gguf \\
        --server-args "--model-path /tmp/smol/model.gguf \\
                       --tokenizer-path ../shared/models/smollm2-135m-instruct" \\
        --output bench/results/serving-sweep.md

``--dummy-model llama-8b`` writes a Llama-3.1-8B-shaped ``config.json`` (``bench/one_batch.py``'s
``LLAMA_8B``) to a temp folder and adds ``--model-path DIR --load-format dummy`` (random bf16
weights); give a ``--tokenizer-path`` in ``--server-args``. Prompt lengths are counted with the
server's tokenizer, and rows with prompt + output > the server's context are skipped.
``--time-limit-s`` counts from this script's start (launch included): at the limit the running
level is cut and the rest are skipped, so a fixed time budget still yields a table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path[:0] = [BENCH, REPO]
from serving import (SWEEP_HEADER, add_client_args, finish_args, load_requests,  # noqa: E402
                     sweep, sweep_row)

# (column, regex with the seconds in group 1) on the server log; the largest match (TP ranks)
LOG_TIMES = [
    ("weight load (s)", r"Load weight end\. Time elapsed: ([\d.]+) s"),
    ("CUDA graph capture (s)", r"Capture cuda graph end\. Time elapsed: ([\d.]+) s"),
    ("engine build (s)", r"\[engine\] INFO weights loaded in ([\d.]+) s"),
    ("engine warm-up (s)", r"\[engine\] INFO warm-up done in ([\d.]+) s"),
    ("server warm-up (s)", r"server: warm-up done in ([\d.]+) s"),
]
KV_TOKENS = r"KV cache: (\d+) tokens"
PROBE = """import json, os, torch
try:
    import flashinfer; fi = flashinfer.__version__
except Exception:
    fi = None
gpu = torch.cuda.is_available()
print(json.dumps({"device": torch.cuda.get_device_name(0) if gpu else "CPU",
                  "count": torch.cuda.device_count() if gpu else 0, "torch": torch.__version__,
                  "flashinfer": fi, "cpus": os.cpu_count()}))"""


def hardware() -> dict:
    """Device name (or "CPU"), GPU count, torch / flashinfer versions and CPU count, probed in
    a child process so this one holds no CUDA context while the server sizes its KV cache."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=120)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"device": "unknown", "count": 0, "torch": "?", "flashinfer": None,
                "cpus": os.cpu_count()}


def write_dummy_model(name: str) -> str:
    """A temp folder with only ``config.json`` for ``--load-format dummy``. Returns its path."""
    from bench.one_batch import LLAMA_8B

    configs = {"llama-8b": {**LLAMA_8B, "model_type": "llama", "torch_dtype": "bfloat16"}}
    path = tempfile.mkdtemp(prefix=f"eyrie-{name}-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(configs[name], f, indent=1)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, base_url: str, timeout_s: float, log_path: str) -> None:
    """Poll ``/health_generate`` every 0.1 s until it answers 200. Raises RuntimeError (with
    the log's tail) if the server exits first, TimeoutError after ``timeout_s`` seconds."""
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                tail = f.read()[-3000:]
            last = ([ln for ln in tail.splitlines() if ln.strip()] or ["(empty log)"])[-1]
            raise RuntimeError(f"server exited with code {proc.returncode} before ready "
                               f"({last.strip()})\n{tail}")
        try:
            if httpx.get(base_url + "/health_generate", timeout=60).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"server not ready after {timeout_s:.0f} s (log: {log_path})")
        time.sleep(0.1)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (API process, engine, TP ranks), SIGKILL what is
    left after 20 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def startup_times(log_path: str) -> dict[str, str]:
    """The start-up columns found in the server log ("-" where a line is absent, e.g. no CUDA
    graphs on CPU)."""
    with open(log_path, errors="replace") as f:
        log = f.read()
    out = {}
    for col, pattern in LOG_TIMES:
        vals = [float(v) for v in re.findall(pattern, log)]
        out[col] = f"{max(vals):.2f}" if vals else "-"
    kv = re.findall(KV_TOKENS, log)
    out["KV cache (tokens)"] = kv[0] if kv else "-"
    return out


def section_header(args: argparse.Namespace, hw: dict, server_cmd: list[str]) -> str:
    dev = hw["device"] if hw["device"] == "CPU" else f"{hw['count']}x {hw['device']}"
    when = utc_now()
    levels = ", ".join(f"{c}:{n}" for c, n in args.levels)
    return "\n".join([
        f"## {args.label}: serving sweep, {when}, {dev}", "",
        f"- Hardware: {dev}, {hw['cpus']} CPU cores; torch {hw['torch']}, flashinfer "
        f"{hw['flashinfer'] or '-'}.",
        f"- Command: `python {shlex.join(sys.argv)}`",
        f"- Server: `python {shlex.join(server_cmd[1:])}`"
        + (f" (model: `{args.dummy_model}` config from `bench/one_batch.py`, random weights)"
           if args.dummy_model else ""),
        f"- Client: `bench/serving.py`, backend {args.backend}, streaming, greedy, "
        f"{'stop at EOS' if args.disable_ignore_eos else 'ignore_eos'}; prompts = the first N "
        f"rows of `{os.path.basename(args.dataset_path)}` with prompt + output <= "
        f"{args.sharegpt_context_len} tokens (prompt tokens by `{args.tokenizer}`), output "
        f"length = `completion_tokens_smollm2` capped at {args.max_output_len}; concurrency:"
        f"prompts {levels}; prefix cache flushed and {args.warmup_requests} warm-up "
        f"request(s) before each level.", ""])


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def startup_table(launch_to_ready: float, times: dict[str, str]) -> str:
    cols = ["launch to ready (s)", *times]
    return "\n".join([
        "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
        f"| {launch_to_ready:.2f} | " + " | ".join(times.values()) + " |", "",
        "Engine build = config + tokenizer + weights + KV cache + CUDA graphs (the engine's "
        "`weights loaded in` line); launch to ready also covers imports, process spawns and "
        "both warm-ups.", ""])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=(
        "Client defaults here: --port a free one, --max-concurrency 1 16 64 256, "
        "--num-prompts-per-concurrency 1:32,16:256,64:512,256:1024, --max-output-len 512, "
        "--sharegpt-context-len the server's context, --tokenizer the server's, no progress "
        "bar."))
    g = p.add_argument_group("server")
    g.add_argument("--label", required=True, help="names the markdown section")
    g.add_argument("--server-args", default="", help="flags for `python -m server` (one "
                   "string; --host/--port come from this script's own flags)")
    g.add_argument("--dummy-model", choices=["llama-8b"], default=None,
                   help="add --model-path <temp dir with this config.json> --load-format dummy")
    g.add_argument("--output", default=None, help="markdown file to append the section to")
    g.add_argument("--server-log", default=None,
                   help="server stdout+stderr (default: a temp file, path printed)")
    g.add_argument("--ready-timeout-s", type=float, default=600.0,
                   help="give up if /health_generate is not 200 by then (default 600)")
    add_client_args(p.add_argument_group("client (bench/serving.py)"))
    p.set_defaults(port=0, max_output_len=512, max_concurrency=[1, 16, 64, 256],
                   num_prompts_per_concurrency="1:32,16:256,64:512,256:1024",
                   disable_tqdm=True)
    args = p.parse_args(argv)
    args.port = args.port or free_port()
    return finish_args(p, args)


def emit(args: argparse.Namespace, text: str) -> None:
    """Print ``text`` and append it to ``--output`` at once (a cut run keeps what it has)."""
    print(text, flush=True)
    if args.output:
        with open(args.output, "a") as f:
            f.write(text + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    signal.signal(signal.SIGTERM, lambda sig, frame: sys.exit(128 + sig))  # run the finally
    server_args = shlex.split(args.server_args)
    if {"--host", "--port"} & set(server_args):
        raise SystemExit("give --host/--port to serving_sweep.py, not in --server-args")
    if args.dummy_model:
        if "--tokenizer-path" not in server_args:
            raise SystemExit("--dummy-model needs --tokenizer-path in --server-args")
        server_args = ["--model-path", write_dummy_model(args.dummy_model), "--load-format",
                       "dummy", *server_args]
    cmd = [sys.executable, "-m", "server", *server_args, "--host", args.host,
           "--port", str(args.port)]
    hw = hardware()
    log_path = args.server_log or tempfile.mkstemp(prefix=f"eyrie-{args.label}-",
                                                   suffix=".log")[1]
    print(f"server log: {log_path}\n$ {shlex.join(cmd)}", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # own process group: one kill ends all
    try:
        try:
            wait_ready(proc, args.base_url, args.ready_timeout_s, log_path)
        except (RuntimeError, TimeoutError) as e:
            emit(args, f"## {args.label}: serving sweep, {utc_now()}\n\n`python "
                       f"{shlex.join(sys.argv)}`: the server did not become ready: "
                       f"{str(e).splitlines()[0]}\n")
            raise
        launch_to_ready = time.monotonic() - t0
        info = httpx.get(args.base_url + "/server_info", timeout=30).json()
        model_info = httpx.get(args.base_url + "/model_info", timeout=30).json()
        args.sharegpt_context_len = args.sharegpt_context_len or info["max_req_input_len"] + 1
        args.tokenizer = args.tokenizer or model_info["tokenizer_path"]
        reqs = load_requests(args)
        if len(reqs) < args.num_prompts:
            print(f"only {len(reqs)} prompts fit the context", file=sys.stderr)
        emit(args, section_header(args, hw, cmd))
        emit(args, startup_table(launch_to_ready, startup_times(log_path)))
        emit(args, SWEEP_HEADER)
        if args.time_limit_s is not None:  # the limit counts from this script's start
            args.time_limit_s = max(0.0, args.time_limit_s - (time.monotonic() - t_start))
        rows = asyncio.run(sweep(args, reqs, on_level=lambda m: emit(args, sweep_row(m))))
        emit(args, "")
        return 0 if all(m.get("failed", 0) == 0 for m in rows) else 1
    finally:
        stop_server(proc)
        print(f"server stopped; log: {log_path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
