"""The FastAPI app: routes only. Request handling lives in ``handlers``, the engine in
``engine_loop``; the app holds no engine state of its own (so several apps can live in one
process, each with its engine loop and metrics registry)."""

from __future__ import annotations

from typing import Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvfit.server.engine_loop import EngineLoop
from kvfit.server.errors import error_response, install_error_handlers, model_not_found
from kvfit.server.handlers import create_chat_completion, create_completion
from kvfit.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList

_API_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")


class _StatusCounter:
    """Pure ASGI middleware counting API responses by status (BaseHTTPMiddleware would get in
    the way of streaming and of disconnect detection)."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or path not in _API_PATHS:
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def build_app(loop: EngineLoop, served_model_name: str,
              aliases: Sequence[str] = ()) -> FastAPI:
    """Routes over ``loop``. ``served_model_name`` is what /v1/models lists and responses carry;
    requests may name it or any alias (or omit ``model``)."""
    # /openapi.json describes the API (schemathesis fuzzes the server from it, tests/)
    app = FastAPI(title="kvfit", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_error_handlers(app)
    app.add_middleware(_StatusCounter, metrics=loop.metrics)
    app.state.engine_loop = loop
    names = {served_model_name, *aliases}

    def check_model(name: Optional[str]) -> None:
        if name is not None and name not in names:
            raise model_not_found(name)

    @app.get("/health")
    async def health():
        if not loop.alive:
            return error_response(loop.unavailable_error())
        return JSONResponse({"status": "ok"})

    def card() -> ModelCard:
        return ModelCard(id=served_model_name, max_model_len=loop.max_model_len)

    @app.get("/v1/models")
    async def models():
        return JSONResponse(ModelList(data=[card()]).model_dump())

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        """One model by its id (the served name or an alias); 404 in OpenAI's shape else."""
        check_model(model)
        return JSONResponse(card().model_dump())

    @app.get("/metrics")
    async def metrics():
        return Response(loop.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body.model)
        return await create_completion(body, raw, loop, served_model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        check_model(body.model)
        return await create_chat_completion(body, raw, loop, served_model_name)

    return app
