"""FastAPI app factory: OpenAI routes, vLLM's tokenizer routes, health, models and metrics around
one AsyncLLMEngine.

The app owns the async engine's lifetime through the lifespan: it starts the engine threads on
startup and, on shutdown, stops admitting (503), lets in-flight requests finish for a grace period,
then aborts the rest so every client gets a full response or a clear end.
"""

from __future__ import annotations

import secrets
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version as distribution_version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.async_engine import AsyncLLMEngine
from engine.server import errors
from engine.server.limits import BodyLimitMiddleware, default_body_limit
from engine.server.metrics import ServerMetrics
from engine.server.chat_protocol import ChatCompletionRequest
from engine.server.protocol import CompletionRequest
from engine.server.responses import ModelCard, ModelList
from engine.server.serving import OpenAIServing
from engine.server.tokenization import (DetokenizeRequest, DetokenizeResponse, OpenAIServingTokenization,
                                        TokenizeResponse, tokenize_request)


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # the name clients send as "model"
    max_model_len: int
    api_key: str | None = None  # when set, /v1 routes need "Authorization: Bearer <api_key>"
    model_aliases: tuple[str, ...] = ()  # other names accepted for the same model (its path)
    model_root: str | None = None  # the model path as given, a card's `root` (None: the served name)
    shutdown_grace_s: float = 30.0
    info: tuple[tuple[str, str], ...] = ()  # (key, value) pairs shown as lengthwise:server_info
    max_body_bytes: int | None = None  # larger request bodies get a 413; None: default_body_limit()
    # Origins whose browser pages may call the API (CORS); empty: none, so browsers refuse
    # cross-origin calls. "*" allows any page, as vLLM's default does.
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.max_body_bytes is not None and self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")


@dataclass(frozen=True)
class ServedApp:
    """What one app's routes use, kept in `app.state.served`. The routes are module functions that
    read it from the request, as vLLM's are: FastAPI caches every route function it inspects,
    process-wide, so a route closing over one app's engine would keep that engine (its KV cache and
    swap pool) alive after the app stops."""

    engine: AsyncLLMEngine
    metrics: ServerMetrics
    settings: ServerSettings
    serving: OpenAIServing
    tokenization: OpenAIServingTokenization

    def check_model(self, name: str | None) -> None:
        # An empty name means the served model, as vLLM takes it (clients send "" when none is chosen).
        if name and name != self.settings.model_name and name not in self.settings.model_aliases:
            raise errors.APIError(404, f"The model `{name}` does not exist.", type="not_found_error",
                                  param="model", code="model_not_found")


def create_app(engine: AsyncLLMEngine, tokenizer: Any, settings: ServerSettings) -> FastAPI:
    # Read when /metrics is scraped, on the event loop, which owns the async engine's pending table.
    # A failed engine reports no state: its last snapshot (requests running, KV in use) would stand
    # for as long as the process lives, while /health says it is dead.
    metrics = ServerMetrics(settings.model_name, lambda: None if engine.failure else engine.stats,
                            dict(settings.info), pending=lambda: engine.num_pending)
    engine.attach_listener(metrics)
    # The engine's own policy says whether a nonzero priority means anything.
    serving = OpenAIServing(engine, tokenizer, settings.model_name, settings.max_model_len, policy=engine.policy)
    tokenization = OpenAIServingTokenization(tokenizer, settings.max_model_len, serving.max_token_chars,
                                             serving.off_loop)
    app = FastAPI(title="lengthwise", lifespan=_lifespan)
    app.state.served = ServedApp(engine, metrics, settings, serving, tokenization)
    errors.install_error_handlers(app)
    _add_middleware(app, settings, serving.max_token_bytes)
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    # vLLM answers /ping (GET or POST, for SageMaker-style probes) exactly as /health.
    app.add_api_route("/ping", health, methods=["GET", "POST"])
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/metrics", prometheus_metrics, methods=["GET"])
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    served: ServedApp = app.state.served
    await served.engine.start()
    yield
    await served.engine.shutdown(served.settings.shutdown_grace_s)
    served.serving.close()


def _served(request: Request) -> ServedApp:
    return request.app.state.served


async def completions(body: CompletionRequest, request: Request):
    served = _served(request)
    served.check_model(body.model)
    return await served.serving.completion(body, request)


async def chat_completions(body: ChatCompletionRequest, request: Request):
    served = _served(request)
    served.check_model(body.model)
    return await served.serving.chat(body, request)


async def tokenize(body: dict[str, Any], request: Request) -> TokenizeResponse:
    served, parsed = _served(request), tokenize_request(body)
    served.check_model(parsed.model)
    return await served.tokenization.tokenize(parsed)


async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    served = _served(request)
    served.check_model(body.model)
    return await served.tokenization.detokenize(body)


async def models(request: Request) -> ModelList:
    settings = _served(request).settings
    return ModelList(data=[ModelCard(id=settings.model_name, root=settings.model_root or settings.model_name,
                                     max_model_len=settings.max_model_len)])


async def health(request: Request) -> Response:
    engine = _served(request).engine
    if engine.failure:
        return errors.engine_failed(engine.failure).response()
    if (stalled := engine.stalled_s) is not None:  # read once: it may change while this runs
        return errors.engine_failed(f"stalled, the engine has made no progress for {stalled:.0f} s").response()
    if engine.accepting:
        return Response(status_code=200)
    return errors.shutting_down().response()


async def version() -> dict[str, str]:
    return {"version": package_version()}


async def prometheus_metrics(request: Request) -> Response:
    return Response(_served(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_middleware(app: FastAPI, settings: ServerSettings, max_token_bytes: int) -> None:
    """Starlette runs the middleware added last first: CORS, then the API key, then the body limit."""
    body_limit = settings.max_body_bytes or default_body_limit(settings.max_model_len, max_token_bytes)
    app.add_middleware(BodyLimitMiddleware, max_bytes=body_limit)
    if settings.api_key is not None:  # added after the body limit, so checked before it
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    if settings.allowed_origins:  # outermost: a preflight is answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"])


def package_version() -> str:
    """The installed lengthwise distribution's version; "unknown" when run from an uninstalled tree."""
    try:
        return distribution_version("lengthwise")
    except PackageNotFoundError:
        return "unknown"


class ApiKeyMiddleware:
    """Refuses /v1 requests without "Authorization: Bearer <key>" before anything reads the body.

    A route dependency would run only after FastAPI parsed the JSON body, so a caller with a wrong
    key and a malformed body learned about the body (400) instead of being refused (401).
    OPTIONS passes, as vLLM lets it: browsers send CORS preflights without credentials, and no
    route answers OPTIONS with data.
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        guarded = scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS"
        if guarded and not self._authorized(scope):
            await errors.unauthorized().response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization")
        return given is not None and secrets.compare_digest(given, self.expected)
