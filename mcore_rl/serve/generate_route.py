"""The seed's `POST /generate {"prompt": ...} -> {"response": ...}` on vLLM's OpenAI server.

Added through vLLM's endpoint-plugin hook (entry point `vllm.endpoint_plugins`, allow-listed by
`mcore-rl serve` in VLLM_PLUGINS) so the server stays vLLM's own. The route is a thin
translation into a `/v1/completions` request handled by vLLM's completion handler: prompt
length, context and max_tokens are checked there and come back as vLLM's 4xx errors. Two
things vLLM leaves undone are done here: its API-key middleware guards only /v1-style paths, so
this route checks the key itself, and it has no request-body limit, so one is added for every
route (413 before the body is read in full).
"""

from __future__ import annotations

import hashlib
import secrets
from http import HTTPStatus

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

DEFAULT_MAX_BODY_BYTES = 8 * 1024 ** 2
"""Request bodies above this are refused with 413 (`mcore-rl serve --max-body-mb`)."""

router = APIRouter()


class GenerateRequest(BaseModel):
    """The seed's request body; unknown fields are refused (a typo is not silently ignored)."""

    model_config = ConfigDict(extra="forbid")
    prompt: StrictStr = Field(min_length=1, description="text to continue (no chat template)")
    max_tokens: StrictInt = Field(default=64, ge=1, description="new tokens at most")
    temperature: StrictFloat | StrictInt = Field(default=0.0, ge=0.0,
                                                description="0 is greedy")


def _api_keys(request: Request) -> list[str]:
    """The keys vLLM's middleware enforces on /v1 (its own rule: --api-key, else VLLM_API_KEY)."""
    import vllm.envs as envs

    args = request.app.state.args
    return [key for key in (args.api_key or [envs.VLLM_API_KEY]) if key]


def require_api_key(request: Request) -> None:
    keys = _api_keys(request)
    if not keys:
        return
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    digest = hashlib.sha256(token.encode()).digest()
    if scheme.lower() != "bearer" or not any(
            secrets.compare_digest(digest, hashlib.sha256(key.encode()).digest()) for key in keys):
        raise _Unauthorized()


class _Unauthorized(Exception):
    pass


@router.post("/generate", dependencies=[Depends(require_api_key)])
async def generate(body: GenerateRequest, raw_request: Request):
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse

    handler = raw_request.app.state.openai_serving_completion
    served_name = raw_request.app.state.openai_serving_models.base_model_paths[0].name
    request = CompletionRequest(model=served_name, prompt=body.prompt,
                                max_tokens=body.max_tokens, temperature=body.temperature)
    result = await handler.create_completion(request, raw_request)
    if not isinstance(result, CompletionResponse):  # vLLM's ErrorResponse, with its status
        return JSONResponse(content=result.model_dump(), status_code=result.error.code)
    return {"response": result.choices[0].text}


class BodySizeLimit:
    """ASGI middleware: 413 for a body over `max_bytes`, by Content-Length or as it streams."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, send)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, counted_receive, send)
        except _BodyTooLarge:
            await self._refuse(scope, send)

    async def _refuse(self, scope, send):
        response = JSONResponse(status_code=HTTPStatus.REQUEST_ENTITY_TOO_LARGE, content=_error(
            f"request body larger than {self.max_bytes} bytes (mcore-rl serve --max-body-mb)",
            "body", HTTPStatus.REQUEST_ENTITY_TOO_LARGE))
        await response(scope, None, send)


class _BodyTooLarge(Exception):
    pass


def _error(message: str, param: str | None, status: HTTPStatus) -> dict:
    """vLLM's error shape, so clients parse one format."""
    return {"error": {"message": message, "type": status.phrase, "param": param,
                      "code": status.value}}


class GenerateEndpoint:
    """vLLM endpoint plugin: /generate, the API-key check for it, the body-size limit."""

    name = "mcore_rl_generate"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)
        app.add_exception_handler(_Unauthorized, lambda request, error: JSONResponse(
            status_code=HTTPStatus.UNAUTHORIZED, content=_error(
                "missing or wrong API key (Authorization: Bearer <key>)", "Authorization",
                HTTPStatus.UNAUTHORIZED)))
        max_bytes = getattr(app.state.args, "max_body_bytes", DEFAULT_MAX_BODY_BYTES)
        app.add_middleware(BodySizeLimit, max_bytes=max_bytes)

    async def init_state(self, engine_client, state, args) -> None:
        """Nothing to set up: the route uses vLLM's own completion handler."""
