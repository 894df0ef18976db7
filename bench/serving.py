"""Online serving benchmark against a running server, in the manner of ``sglang.bench_serving``.

Sends streaming requests (native ``/generate``, ``/v1/completions`` or ``/v1/chat/completions``)
from ShareGPT prompts (``--dataset-path``, output length = ``completion_tokens_smollm2`` capped
by ``--max-output-len``) or random token ids, paced by ``--request-rate`` (Poisson, req/s) and/or
capped by ``--max-concurrency``, and prints a table: request / input / output throughput and
TTFT, TPOT, ITL, E2E latency (mean, median, p99) in milliseconds.

Several ``--max-concurrency`` values run one after another (a sweep), each on the first N
prompts (``--num-prompts-per-concurrency 1:32,16:256``, else ``--num-prompts``), with the prefix
cache flushed before each level so no level reuses another's prompts; one row per level.

Metric definitions and the request machinery: ``bench/serving_client.py``. Server launch,
start-up timings and a dated markdown record: ``bench/serving_sweep.py``.

    python -m server &                       # default SmolLM2 model on 127.0.0.1:30000
    python bench/serving.py --num-prompts 50 --max-concurrency 8 --max-output-len 64
    python bench/serving.py --max-concurrency 1 16 --num-prompts-per-concurrency 1:8,16:64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Callable

_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_BENCH, os.path.dirname(_BENCH)]  # serving_client; engine (for --tokenizer)
from serving_client import (CUT, Request, default_dataset_path, load_requests,  # noqa: E402
                            run, summarize)

__all__ = ["Request", "load_requests", "run", "summarize", "sweep", "sweep_levels",
           "sweep_row", "SWEEP_HEADER", "add_client_args", "finish_args", "print_table"]


def print_table(m: dict[str, float], args: argparse.Namespace) -> None:
    rows = [("Backend", args.backend), ("Request rate (req/s)", args.request_rate),
            ("Max concurrency", m.get("max_concurrency") or "-"),
            ("Successful requests", int(m["completed"])), ("Failed requests", int(m["failed"])),
            ("Benchmark duration (s)", f"{m['duration_s']:.2f}"),
            ("Total input tokens", int(m["total_input_tokens"])),
            ("Total output tokens", int(m["total_output_tokens"])),
            ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
            ("Input token throughput (tok/s)", f"{m['input_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{m['total_throughput']:.2f}"),
            ("Concurrency", f"{m['concurrency']:.2f}")]
    if m["cut"]:
        rows.insert(5, ("Cut at the time limit", int(m["cut"])))
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {label} (ms)", f"{m[f'{stat}_{name}_ms']:.2f}"))
    print("| metric | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")


# ---- concurrency sweep -----------------------------------------------------------------------
SWEEP_HEADER = ("| max concurrency | prompts | ok / failed | duration (s) | input / output "
                "tokens | req/s | output tok/s | TTFT mean / median / p99 (ms) | ITL mean / "
                "median / p99 (ms) | E2E mean / median / p99 (ms) |\n|" + "---|" * 10)


def sweep_levels(args: argparse.Namespace) -> list[tuple[int | None, int]]:
    """(max concurrency, prompt count) per level: ``--max-concurrency`` values in order, each
    with its ``--num-prompts-per-concurrency`` count (``"1:32,16:256"``), else ``--num-prompts``.
    Raises ValueError for a malformed count spec."""
    counts = {}
    for item in filter(None, (args.num_prompts_per_concurrency or "").split(",")):
        c, _, n = item.partition(":")
        if not n:
            raise ValueError(f"--num-prompts-per-concurrency: {item!r} is not CONCURRENCY:COUNT")
        counts[int(c)] = int(n)
    return [(c, counts.get(c, args.num_prompts)) for c in (args.max_concurrency or [None])]


def sweep_row(m: dict[str, float]) -> str:
    """One markdown row of ``SWEEP_HEADER`` for a ``summarize`` dict (plus ``max_concurrency``,
    ``num_prompts``, and ``skipped`` when the time limit came before the level)."""
    head = f"| {m['max_concurrency'] or '-'} | {m['num_prompts']} |"
    if m.get("skipped"):
        return head + " skipped (time limit) |" + " - |" * 7
    ok = f"{m['completed']} / {m['failed']}" + (f" ({m['cut']} cut)" if m["cut"] else "")

    def trio(name: str) -> str:
        return " / ".join(f"{m[f'{s}_{name}_ms']:.1f}" for s in ("mean", "median", "p99"))

    return (f"{head} {ok} | {m['duration_s']:.1f} | {m['total_input_tokens']} / "
            f"{m['total_output_tokens']} | {m['request_throughput']:.2f} | "
            f"{m['output_throughput']:.0f} | {trio('ttft')} | {trio('itl')} | {trio('e2e')} |")


async def sweep(args: argparse.Namespace, reqs: list[Request],
                on_level: Callable[[dict], None] | None = None) -> list[dict[str, float]]:
    """Run every level of ``args.levels`` (see ``finish_args``) on the first N of ``reqs``;
    the prefix cache is flushed before each level when there are several (or with
    ``--flush-cache``). After ``--time-limit-s`` the running level is cut and later ones are
    skipped. ``on_level(m)`` is called with each level's metrics as soon as it ends."""
    levels = args.levels
    deadline = None if args.time_limit_s is None else time.monotonic() + args.time_limit_s
    rows = []
    for c, n in levels:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            m: dict[str, float] = {"skipped": 1}
        else:
            results, duration = await run(args, reqs[:n], c, args.flush_cache or len(levels) > 1,
                                          left)
            m = summarize(results, duration)
            errors = [r.error for r in results if not r.ok and r.error != CUT]
            if errors:
                print(f"{len(errors)} failed; errors: {errors[:5]}", file=sys.stderr)
        m.update(max_concurrency=c, num_prompts=min(n, len(reqs)))
        rows.append(m)
        if on_level is not None:
            on_level(m)
    return rows


def add_client_args(p: argparse.ArgumentParser) -> None:
    """The load generator's flags (shared with ``serving_sweep.py``)."""
    p.add_argument("--base-url", default=None, help="default http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--backend", default="sglang", choices=["sglang", "openai", "openai-chat"])
    p.add_argument("--model", default=None, help="OpenAI backends: default from /v1/models")
    p.add_argument("--dataset-name", default="sharegpt", choices=["sharegpt", "random"])
    p.add_argument("--dataset-path", "--dataset", default=default_dataset_path(),
                   help="ShareGPT jsonl (default: shared/data/ beside the checkout, else "
                        "/work/shared/data/)")
    p.add_argument("--tokenizer", default=None,
                   help="count prompt tokens with this tokenizer (default: the file's "
                        "prompt_tokens_smollm2)")
    p.add_argument("--sharegpt-context-len", type=int, default=None,
                   help="skip ShareGPT rows whose prompt + output tokens exceed this")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--num-prompts-per-concurrency", default=None, metavar="C:N,...",
                   help="prompt count per --max-concurrency level, e.g. 1:32,16:256")
    p.add_argument("--max-output-len", type=int, default=64,
                   help="cap on the ShareGPT output length (tokens)")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-vocab-size", type=int, default=500,
                   help="random prompts use token ids in [1, this)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate (req/s); inf sends all at once")
    p.add_argument("--max-concurrency", "--concurrency", type=int, nargs="+", default=None,
                   help="one value, or several for a sweep (one level each, in order)")
    p.add_argument("--flush-cache", action="store_true",
                   help="POST /flush_cache before the run (always done between sweep levels)")
    p.add_argument("--warmup-requests", type=int, default=1,
                   help="unmeasured requests (16 output tokens) before each level")
    p.add_argument("--time-limit-s", type=float, default=None,
                   help="cut the running level and skip the rest after this many seconds")
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--disable-tqdm", action="store_true")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_client_args(p)
    p.add_argument("--output-file", default=None, help="append the metrics as JSON lines")
    return finish_args(p, p.parse_args(argv))


def finish_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Derived values: ``base_url``; ``levels`` = ``sweep_levels``; ``num_prompts`` = the
    largest count any level needs (the prompts to load). A bad count spec exits via ``p``."""
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    try:
        args.levels = sweep_levels(args)
    except ValueError as e:
        p.error(str(e))
    args.num_prompts = max(n for _, n in args.levels)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reqs = load_requests(args)
    rows = asyncio.run(sweep(args, reqs))
    if len(rows) == 1 and not rows[0].get("skipped"):
        print_table(rows[0], args)
    else:
        print("\n".join([SWEEP_HEADER] + [sweep_row(m) for m in rows]))
    if args.output_file:
        with open(args.output_file, "a") as f:
            for m in rows:
                f.write(json.dumps({"args": vars(args), **m}) + "\n")
    return 0 if all(m.get("failed", 0) == 0 for m in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
