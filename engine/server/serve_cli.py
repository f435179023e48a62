"""`lengthwise serve`: build the engine, the length predictor and the HTTP app, then run uvicorn.

The predictor comes as a saved folder or `none`: before `run`, the CLI (training/cli.py) has
training/serve_predictor.py resolve `--predictor champion` through the MLflow registry, which the
engine never reads. On SIGINT/SIGTERM the server stops admitting (503), lets in-flight requests
finish for --shutdown-grace seconds, then aborts the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
from pathlib import Path

import uvicorn

from engine.arg_types import (API_KEY_VARIABLES, api_key, api_key_or_environment, configure_serve_logging,
                              cors_origin, named_path, non_negative_float, port_number, positive_float,
                              positive_int)
from engine.config import DEFAULT_MODEL, REPO_ROOT, SERVED_MODEL_HUB_ID, model_path
from engine.scheduler_args import add_scheduler_arguments, scheduler_options
from predictor.saved import SPEC_FILENAME, read_spec

logger = logging.getLogger("lengthwise.serve")

# After the engine has drained, what uvicorn waits for handlers to send their last events.
FLUSH_AFTER_DRAIN_S = 5
FORCE_EXIT_POLL_S = 0.1  # how soon a second stop signal cuts the grace period short
LISTEN_BACKLOG = 2048  # uvicorn's default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.config import DEFAULT_MODEL, EngineConfig
    from scheduler.policies import POLICIES

    defaults = EngineConfig()  # its checks only: no model is read

    servable = [name for name, policy in POLICIES.items() if not policy.needs_true_length]

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="converted model folder, as `vllm serve MODEL` takes it (or --model)")
    parser.add_argument("--model", default=None, help=f"converted model folder (default {DEFAULT_MODEL})")
    parser.add_argument("--served-model-name", default=None,
                        help="name clients send (default: the folder's name, or the hub id the model was named by)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    parser.add_argument("--port", type=port_number, default=8000, help="default %(default)s (0: a free one)")
    parser.add_argument("--policy", "--scheduling-policy", choices=servable, default=None,
                        help="waiting-queue order (default: sjf, shortest predicted output first with aging; "
                             "fcfs, vLLM's default, with --predictor none; --scheduling-policy is vLLM's name)")
    parser.add_argument("--predictor", default="champion",
                        help="saved predictor folder, 'champion' (MLflow registry) or 'none'")
    parser.add_argument("--store", type=named_path, default=None, metavar="DIR",
                        help="the MLflow store whose champion --predictor champion serves, as train and "
                             "eval-predictor take it (default mlruns/; a store named must hold one)")
    parser.add_argument("--kv-cache-memory", type=positive_float, default=None, metavar="GIB",
                        help=f"memory for the paged KV cache in GiB (default {defaults.kv_cache_memory_gib:g})")
    parser.add_argument("--max-num-seqs", type=positive_int, default=None,
                        help=f"requests running at once (default {defaults.max_num_seqs})")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                        help=f"tokens one engine step may run (default {defaults.max_num_batched_tokens})")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help=f"the longest prompt plus output (default {defaults.max_model_len}; at most the "
                             "model's positions)")
    parser.add_argument("--preemption-mode", choices=("recompute", "swap"), default=None,
                        help=f"default {defaults.preemption_mode}")
    parser.add_argument("--swap-space", type=positive_float, default=None, metavar="GIB",
                        help=f"host memory in GiB that swap preemption copies KV blocks to (default "
                             f"{defaults.swap_space_gib:g}; with --preemption-mode swap only)")
    parser.add_argument("--enable-prefix-caching", action="store_true",
                        help="find full KV blocks of earlier prompts again by their tokens, so a prompt that "
                             "starts as one before it skips that part of its prefill (vLLM's automatic prefix "
                             "caching)")
    parser.add_argument("--attention-backend", choices=("auto", "torch", "triton"), default=None,
                        help=f"default {defaults.attention_backend}: Triton on a GPU, else the torch reference")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "auto"), default=None,
                        help=f"weights and KV cache (default {defaults.dtype}; auto: float32 on a CPU, "
                             "bfloat16 on a GPU that has it, else float16)")
    add_scheduler_arguments(parser)
    parser.add_argument("--api-key", type=api_key, default=None,
                        help="require 'Authorization: Bearer <key>' on /v1 (default: $LENGTHWISE_API_KEY, "
                             "else $VLLM_API_KEY, else none)")
    parser.add_argument("--allowed-origins", nargs="+", type=cors_origin, default=(), metavar="ORIGIN",
                        help="origins whose browser pages may call the API (CORS), or '*' for any; "
                             "default: none")
    parser.add_argument("--max-body-bytes", type=positive_int, default=None, metavar="N",
                        help="the largest request body taken (413 beyond it); default: room for one prompt "
                             "that fills the context, so a large completions batch may need more")
    parser.add_argument("--shutdown-grace", type=non_negative_float, default=30.0, metavar="S",
                        help="seconds in-flight requests may finish after a stop signal")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def served_policy(policy: str | None, predictor: str | None) -> str:
    """The policy asked for; unasked, sjf where a predictor ranks requests, else fcfs: sjf without
    one orders by max_tokens, which a chat without it sets to the rest of the context, so the
    shortest prompts, the longest budgets, would go last by a rule nobody asked for."""
    if policy is not None:
        return policy
    return "fcfs" if predictor is None or predictor.lower() == "none" else "sjf"


def warn_if_ordering_without_predictor(policy: str, predictor_path: str | None) -> None:
    """A length policy with no predictor orders by `max_tokens` (each request's only length): a
    valid order, but not the one asked for, so it is said."""
    from scheduler.policies import POLICIES

    if predictor_path is None and POLICIES[policy].orders_by_prediction:
        logger.warning("--policy %s with --predictor none orders requests by max_tokens, not by a "
                       "predicted length", policy)


def warn_if_probing_another_model(length_predictor, served_model: str) -> None:
    """A probe predictor reads a model's own states; serving another model, it predicts that
    model's lengths, not the served one's. Allowed (it still ranks), but said."""
    probed = getattr(length_predictor, "probed_model_dir", None)
    if probed is not None and Path(probed).resolve() != Path(served_model).resolve():
        logger.warning("the predictor probes %s, not the served model %s: it predicts that model's "
                       "output lengths", probed, served_model)


def build_engine_config(args: argparse.Namespace):
    from engine.config import EngineConfig
    from scheduler.eviction import needs_host_pool

    overrides = {
        "kv_cache_memory_gib": args.kv_cache_memory, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
        "preemption_mode": args.preemption_mode, "attention_backend": args.attention_backend,
        "dtype": args.dtype, "swap_space_gib": args.swap_space,
    }
    chosen = {name: value for name, value in overrides.items() if value is not None}
    if args.swap_space is not None and not needs_host_pool(chosen.get("preemption_mode", EngineConfig.preemption_mode)):
        # Recompute preemption copies nothing to the host: the pool would be allocated unused.
        raise ValueError("--swap-space is used only with --preemption-mode swap")
    # The engine gets no predictor path: the async engine scores arrivals in batches itself.
    policy = served_policy(args.policy, args.predictor)
    options = scheduler_options(args, [policy])
    if args.enable_prefix_caching:  # not a shared scheduler flag: simulated prompts are all one token
        options["enable_prefix_caching"] = True
    return EngineConfig(model=model_folder(args), policy=policy, scheduler_options=options, **chosen)


def model_folder(args: argparse.Namespace) -> str:
    """The model to serve: the positional MODEL (vLLM's form) or --model, the default without
    either; both, naming different folders, is an error rather than a guess."""
    if (args.model_tag is not None and args.model is not None
            and Path(model_path(args.model_tag)).resolve() != Path(model_path(args.model)).resolve()):
        raise ValueError(f"the model is named twice: {args.model_tag} and --model {args.model}")
    return args.model_tag or args.model or DEFAULT_MODEL


def predictor_folder(spec: str | None) -> str | None:
    """The saved predictor folder `spec` names, or None for 'none'."""
    if spec is None or spec.lower() == "none":
        return None
    if not (Path(spec) / SPEC_FILENAME).is_file():
        raise FileNotFoundError(f"--predictor {spec}: not a saved predictor folder (no predictor.json)")
    read_spec(Path(spec))  # a spec that is not JSON or names no kind fails now, not after the model loads
    return spec


def run(args: argparse.Namespace) -> int:
    configure_serve_logging(args.log_level)
    from engine.llm_engine import check_model_dir

    if args.api_key is None:  # before the model loads: an empty variable is an error
        args.api_key = api_key_or_environment(None)
        if args.api_key is not None:
            logger.info("requests to /v1 need the API key from the environment (%s)", ", ".join(API_KEY_VARIABLES))
    config = build_engine_config(args)
    predictor_path = predictor_folder(args.predictor)
    warn_if_ordering_without_predictor(config.policy, predictor_path)
    check_model_dir(config.model)
    listening = listen_sockets(args.host, args.port)  # a taken port fails now, not after the model loads
    try:
        server, name = build_server(args, config, predictor_path)
    except BaseException:
        for sock in listening:
            sock.close()
        raise
    logger.info("serving %s with policy %s on http://%s:%d", name, config.policy, url_host(args.host),
                listening[0].getsockname()[1])
    try:
        server.run(sockets=listening)
    except KeyboardInterrupt:
        # uvicorn re-raises the Ctrl-C it caught once shutdown (our drain included) is complete.
        return 130
    # Started with SIGINT ignored (a script's background job), uvicorn still stops on it, but the
    # SIGINT it raises again on the way out is ignored: the interrupt is still what ended it.
    return 130 if server.stop_signal == signal.SIGINT else 0


def build_server(args: argparse.Namespace, config, predictor_path: str | None) -> tuple["DrainingServer", str]:
    """The engine, the predictor and the app, in a server not yet started; and the served name."""
    import predictor
    from engine.async_engine import AsyncLLMEngine
    from engine.llm_engine import LLMEngine, load_tokenizer
    from engine.server.app import ServerSettings, create_app

    engine = LLMEngine(config)
    too_small = kv_shortfall(engine.scheduler.config)
    if too_small:
        raise ValueError(too_small)  # one line and exit status 2 at the CLI boundary
    logger.info("attention backend: %s (asked for %s)", attention_backend_name(engine),
                config.attention_backend)
    length_predictor = predictor.load(predictor_path) if predictor_path else None
    warn_if_probing_another_model(length_predictor, config.model)
    name = args.served_model_name or served_name(args.model_tag or args.model, config.model)
    info = {"policy": config.policy, "predictor": predictor_path or "none",
            "attention_backend": attention_backend_name(engine), "max_num_seqs": str(config.max_num_seqs),
            "max_num_batched_tokens": str(config.max_num_batched_tokens),
            "num_gpu_blocks": str(engine.scheduler.config.num_gpu_blocks)}
    settings = ServerSettings(model_name=name, max_model_len=config.max_model_len, api_key=args.api_key,
                              model_aliases=model_aliases(config.model), model_root=config.model,
                              shutdown_grace_s=args.shutdown_grace,
                              allowed_origins=tuple(args.allowed_origins), info=tuple(info.items()),
                              max_body_bytes=args.max_body_bytes)
    # On a GPU the predictor may run on the idle CPU while the engine steps; on a CPU it waits.
    async_engine = AsyncLLMEngine(engine, length_predictor,
                                  overlap_prediction=engine.device.type == "cuda")
    # The HTTP layer's own tokenizer: the engine thread decodes with its copy while requests are
    # encoded, and a fast tokenizer shared across threads can fail with "Already borrowed".
    app = create_app(async_engine, load_tokenizer(config.model), settings)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=FLUSH_AFTER_DRAIN_S),
                            async_engine, args.shutdown_grace)
    return server, name


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address `host` resolves to ("" for all interfaces), as asyncio
    binds them for uvicorn (IPv6 ones IPv6-only); OSError naming both flags when the port is taken
    or the host resolves to nothing. Port 0 takes a free port (the log line says which): the
    first address's, which the others then take too, so every address serves on one port."""
    try:
        addresses = dict.fromkeys(socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                     flags=socket.AI_PASSIVE))
    except OSError as exc:
        raise OSError(f"--host {host}: cannot listen there ({exc.strerror or exc})") from None
    sockets = []
    try:
        for family, kind, proto, _, address in addresses:
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(LISTEN_BACKLOG)  # bound but not listening, a port taken the same way would pass
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise OSError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
    return sockets


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def served_name(given: str | None, folder: str) -> str:
    """The name /v1/models lists by default: the hub id where the model was named by it, as vLLM
    lists what it was given; else the folder's name."""
    return SERVED_MODEL_HUB_ID if given == SERVED_MODEL_HUB_ID else Path(folder).name


def model_aliases(model: str) -> tuple[str, ...]:
    """Names a client may send besides the served name: the model path as given, absolute, and
    relative to the repository (the default is absolute; clients sent data/models/... before),
    and for the default model its hub id, as vLLM's clients name it."""
    path = Path(model).resolve()
    aliases = [model, str(path)]
    if path.is_relative_to(REPO_ROOT):
        aliases.append(str(path.relative_to(REPO_ROOT)))
    if path == Path(DEFAULT_MODEL).resolve():
        aliases.append(SERVED_MODEL_HUB_ID)
    return tuple(dict.fromkeys(aliases))


def kv_shortfall(scheduler_config) -> str | None:
    """Why the KV cache cannot serve a request of max_model_len tokens, or None when it can.

    As vLLM refuses to start then: otherwise every chat request without max_tokens (whose default
    is the rest of the context) would be refused as too large for the cache."""
    capacity = scheduler_config.num_gpu_blocks * scheduler_config.block_size
    if capacity >= scheduler_config.max_model_len:
        return None
    return (f"the KV cache holds {capacity} tokens, fewer than max_model_len {scheduler_config.max_model_len}: "
            f"raise --kv-cache-memory or lower --max-model-len")


def attention_backend_name(engine) -> str:
    """The backend the engine resolved ('auto' becomes torch or triton)."""
    backend = getattr(getattr(engine, "runner", None), "backend", None)
    return getattr(backend, "name", "unknown")


class DrainingServer(uvicorn.Server):
    """Stops admission the moment a stop signal arrives, then drains the engine before uvicorn
    closes connections: in-flight requests finish within the grace period or end with
    finish_reason "abort" and `[DONE]`, instead of uvicorn cancelling their handlers mid-stream."""

    def __init__(self, config: uvicorn.Config, async_engine, grace_s: float) -> None:
        super().__init__(config)
        self._async_engine = async_engine
        self._grace_s = grace_s
        self.stop_signal: int | None = None  # the first stop signal, if one stopped it

    def handle_exit(self, sig, frame) -> None:
        self._async_engine.begin_drain()
        if self.stop_signal is None:
            self.stop_signal = sig
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        drain = asyncio.ensure_future(self._async_engine.drain(self._grace_s))
        while not drain.done():
            await asyncio.wait({drain}, timeout=FORCE_EXIT_POLL_S)
            if self.force_exit and not drain.done():
                # A second Ctrl-C (uvicorn's force exit): end what still runs now, not at the grace.
                drain.cancel()
                await self._async_engine.drain(0)
        await super().shutdown(sockets=sockets)
        if self.force_exit:  # uvicorn then skips the app's lifespan shutdown, which stops the engine
            await self._async_engine.shutdown(0)
