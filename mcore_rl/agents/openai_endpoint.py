"""A local OpenAI-compatible chat endpoint in front of a rank's engine, for agents written
against the OpenAI API (the SDK, openai-agents, LangChain).

The agent talks text and structured tool calls; the trainer needs the exact token ids the model
was fed and sampled. So the endpoint never trusts text to come back as the same tokens: each
request's prompt reuses the ids of the episode's earlier completion it continues (that
completion's prompt ids + its sampled ids + the chat template's delta for the messages sent
since, chat.py's rule B), found by matching messages, not by the client's cooperation (the SDK
sends our answer back as structured tool calls with no content, so the match compares roles,
contents and tool calls by name and parsed arguments). Only a request that continues none of
them (the client rewrote history) is rendered again, and counted.

Each episode has its own URL prefix (/episodes/<id>/v1), so completions group into episodes with any
client. The id holds 128 random bits: the server listens on loopback, where any local user can
connect, and must not take turns injected into an episode; a request body is read up to
`MAX_BODY_BYTES` only. The server runs in a daemon thread on loopback only; the engine stays with
the rank's main thread (its steps are collectives), so a request only builds its prompt ids here and
waits for the main thread to sample it (`AgentRunner`).

Which request fields are refused, and how request messages are compared and rendered, is
openai_messages.py's.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from mcore_rl.config.agents import MultiTurnConfig

from .chat import ChatFormat, TemplateMismatch
from .openai_messages import _tools_key, _unsupported, signature, template_message
from .tool_calls import ToolCallError, load_parser

HOST = "127.0.0.1"
SERVER_START_SECONDS = 30.0
MAX_BODY_BYTES = 16 << 20
"""A larger request is refused (413) before it is read whole."""


@dataclass
class Turn:
    """One chat completion of an agent episode: the request as the template saw it, and what
    the engine sampled for it."""

    episode: "AgentEpisode"
    turn: int
    """The episode's request count when this one arrived (its seed and engine key follow)."""
    signatures: list[tuple]
    """The request's messages, comparable (`signature`)."""
    tools: str
    """The request's tools (JSON): a completion continues only one offered the same tools."""
    history: list[dict]
    """The request's messages as rendered: the model's turns as their sampled text."""
    prompt_ids: list[int]
    max_new_tokens: int
    """The request's limit on its answer (max_tokens, the episode's room left)."""
    chained: bool
    """Whether the prompt continues an earlier completion's ids (else rendered anew)."""
    sampled_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    routes: object = None
    """The engine's Mixture-of-Experts routes for the prompt and the answer but its last token
    (a tensor; None without r3): Episode.add_routes."""
    versions: tuple = ()
    """The policy versions that sampled its stretches (FinishedSample.versions)."""
    reply: dict | None = None
    """The assistant message returned to the client."""
    done: asyncio.Future | None = None
    """Resolved by the engine's thread once sampled (on the server's event loop)."""


@dataclass
class AgentEpisode:
    """A running agent episode: its completions, in the order the engine finished them."""

    key: str
    """The engine's request keys start with it ("<key>/t<turn>")."""
    prompt_index: int
    sample_index: int
    requests: int = 0
    completions: list[Turn] = field(default_factory=list)
    truncated: bool = False
    """A limit (max_turns, max_episode_tokens) answered a request with no tokens."""
    counts: dict = field(default_factory=lambda: {
        "tool_calls": 0, "parse_failures": 0, "history_rewrites": 0, "template_mismatches": 0})
    prompt_tokens: int = 0
    """The prompt tokens of every engine request the episode made (those of completions off
    its trajectory too: the engine computed them all), and"""
    cached_tokens: int = 0
    """how many of them the engine's prefix cache served."""


class ChatEndpoint:
    """`POST /episodes/<id>/v1/chat/completions` on 127.0.0.1:<free port>, served in a daemon
    thread. Requests become `Turn`s handed to `submit` (the engine's thread), which answers
    each through `finish`."""

    def __init__(self, tokenizer, config: MultiTurnConfig, submit: Callable[[object], None]):
        self.tokenizer = tokenizer
        self.config = config
        self.submit = submit
        """Called with each Turn to sample."""
        self.parse_tool_calls = load_parser(config.tool_parser)
        self.episodes: dict[str, AgentEpisode] = {}
        """The episodes served, by the id in their URL."""
        self._formats: dict[str, ChatFormat] = {}
        self._server, self._thread, self.port = _serve(self._app())

    def base_url(self, episode_id: str) -> str:
        """The OpenAI base_url an agent uses for episode `episode_id`."""
        return f"http://{HOST}:{self.port}/episodes/{episode_id}/v1"

    def chat(self, tools: list[dict] | None) -> ChatFormat:
        """The chat template with a request's tools (made once per tool set)."""
        key = _tools_key(tools)
        if key not in self._formats:
            self._formats[key] = ChatFormat(self.tokenizer, tools,
                                            dict(self.config.template_kwargs))
        return self._formats[key]

    def finish(self, turn: Turn, token_ids: list[int], logprobs: list[float],
               finish_reason: str) -> None:
        """The engine sampled `turn` (called on the engine's thread): record it under its
        episode, then wake the request waiting for it."""
        turn.sampled_ids, turn.logprobs, turn.finish_reason = list(token_ids), list(logprobs), \
            finish_reason
        turn.episode.completions.append(turn)
        turn.done.get_loop().call_soon_threadsafe(_resolve, turn.done)

    def close(self) -> None:
        """Stop serving."""
        self._server.should_exit = True
        self._thread.join(timeout=5)

    # -- one request --------------------------------------------------------------------------
    def _app(self) -> FastAPI:
        app = FastAPI(title="mcore_rl rollout endpoint", openapi_url=None)
        app.post("/episodes/{episode_id}/v1/chat/completions")(self._chat_completions)
        return app

    async def _chat_completions(self, episode_id: str, request: Request):
        episode = self.episodes.get(episode_id)
        if episode is None:
            return _error(404, f"no episode {episode_id!r} is running on this rank")
        raw = await _body(request)
        if raw is None:
            return _error(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "the request body is not JSON")
        problem = _unsupported(body)
        if problem:
            return _error(400, problem)
        chat = self.chat(body.get("tools") or None)
        turn = self._turn(episode, body, chat)
        if turn.max_new_tokens >= 1:
            turn.done = asyncio.get_running_loop().create_future()
            self.submit(turn)
            await turn.done
        else:
            episode.truncated = True
        turn.reply = self._reply_message(turn, chat)
        return _completion(body, turn, self.tokenizer)

    def _turn(self, episode: AgentEpisode, body: dict, chat: ChatFormat) -> Turn:
        """The request as a Turn: its prompt ids continue an earlier completion where one
        matches, else the messages are rendered anew (counted after the first request)."""
        messages, tools = body["messages"], _tools_key(chat.tools)
        signatures = [signature(message) for message in messages]
        turn = episode.requests
        episode.requests += 1
        try:
            chained = self._continued(episode, messages, signatures, tools, chat)
        except TemplateMismatch:  # a history the template renders otherwise: end the episode
            episode.counts["template_mismatches"] += 1
            return Turn(episode, turn, signatures, tools, [], [], 0, chained=False)
        if chained is None:
            episode.counts["history_rewrites"] += bool(episode.completions)
            history = [self._as_sampled(episode, message, chat) for message in messages]
            prompt_ids = chat.prompt_ids(history)
        else:
            prompt_ids, history = chained
        return Turn(episode, turn, signatures, tools, history, prompt_ids,
                    self._room(turn, body, prompt_ids), chained=chained is not None)

    @staticmethod
    def _continued(episode: AgentEpisode, messages: list[dict], signatures: list[tuple],
                   tools: str, chat: ChatFormat) -> tuple[list[int], list[dict]] | None:
        """(prompt ids, rendered history) continuing the latest completion with the same tools
        whose messages start this request's and whose answer is the request's next message;
        None if none."""
        for previous in reversed(episode.completions):
            seen = len(previous.signatures)
            if previous.reply is None or previous.tools != tools or len(messages) <= seen or \
                    signatures[:seen] != previous.signatures or \
                    signatures[seen] != signature(previous.reply):
                continue
            observations = [template_message(message) for message in messages[seen + 1:]]
            delta = chat.observation_ids(previous.history, previous.sampled_ids, observations,
                                         previous.turn + 1)
            history = previous.history + [chat.assistant_message(previous.sampled_ids)] + \
                observations
            return previous.prompt_ids + previous.sampled_ids + delta, history
        return None

    @staticmethod
    def _as_sampled(episode: AgentEpisode, message: dict, chat: ChatFormat) -> dict:
        """A message to render anew: one of the episode's answers becomes its sampled text."""
        for completion in episode.completions:
            if completion.reply is not None and signature(message) == \
                    signature(completion.reply) and completion.sampled_ids:
                return chat.assistant_message(completion.sampled_ids)
        return template_message(message)

    def _room(self, turn: int, body: dict, prompt_ids: list[int]) -> int:
        """Tokens request `turn` may sample: its max_tokens, within the episode's
        max_episode_tokens and max_turns (0: answer "length" without sampling)."""
        if turn >= self.config.max_turns:
            return 0
        room = self.config.max_episode_tokens - len(prompt_ids)
        requested = body.get("max_completion_tokens") or body.get("max_tokens")
        return max(0, min(room, requested) if requested else room)

    def _reply_message(self, turn: Turn, chat: ChatFormat) -> dict:
        """The assistant message for the client: the sampled text without the end-of-turn
        token, its tool calls structured with the text before the first <tool_call> as content
        (hermes; with a user's parser, the whole text). A malformed call is no call: the client
        gets the text (counted as a parse failure)."""
        text = chat.assistant_message(turn.sampled_ids)["content"] if turn.sampled_ids else ""
        try:
            calls = self.parse_tool_calls(text)
        except ToolCallError:
            turn.episode.counts["parse_failures"] += 1
            calls = []
        if not calls:
            return {"role": "assistant", "content": text}
        turn.episode.counts["tool_calls"] += len(calls)
        content = text.split("<tool_call>")[0]
        return {"role": "assistant", "content": content or None, "tool_calls": [
            {"id": f"call_{turn.turn}_{index}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
            for index, call in enumerate(calls)]}


def _completion(body: dict, turn: Turn, tokenizer) -> dict:
    """The OpenAI chat.completion object, plus the token ids (prompt_token_ids and
    choices[0].token_ids, as vLLM's return_token_ids gives them)."""
    finish_reason = "length" if turn.finish_reason == "length" or not turn.sampled_ids else \
        "tool_calls" if turn.reply.get("tool_calls") else "stop"
    choice = {"index": 0, "message": turn.reply, "finish_reason": finish_reason,
              "token_ids": turn.sampled_ids, "logprobs": None}
    if body.get("logprobs"):
        choice["logprobs"] = {"content": [
            {"token": token, "logprob": logprob, "bytes": list(token.encode()),
             "top_logprobs": []}
            for token, logprob in zip(_pieces(tokenizer, turn.sampled_ids), turn.logprobs)]}
    prompt, answer = len(turn.prompt_ids), len(turn.sampled_ids)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model", "policy"),
            "choices": [choice], "prompt_token_ids": turn.prompt_ids,
            "usage": {"prompt_tokens": prompt, "completion_tokens": answer,
                      "total_tokens": prompt + answer}}


def _pieces(tokenizer, token_ids: list[int]) -> list[str]:
    """Each token's own text."""
    return [tokenizer.decode([token_id], skip_special_tokens=False) for token_id in token_ids]


async def _body(request: Request) -> bytes | None:
    """The request's body, or None once it passes MAX_BODY_BYTES (read no further)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return None
    received = bytearray()
    async for chunk in request.stream():
        received += chunk
        if len(received) > MAX_BODY_BYTES:
            return None
    return bytes(received)


def _error(status: int, message: str) -> JSONResponse:
    """An error in OpenAI's format (the SDK raises it with this message)."""
    kind = "invalid_request_error" if status == 400 else "not_found_error"
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "code": None}})


def _resolve(future: asyncio.Future) -> None:
    if not future.done():  # the request may have been cancelled meanwhile
        future.set_result(None)


def _serve(app: FastAPI) -> tuple[uvicorn.Server, threading.Thread, int]:
    """uvicorn serving `app` on 127.0.0.1 at a free port, in a daemon thread."""
    server = uvicorn.Server(uvicorn.Config(app, host=HOST, port=0, log_level="warning",
                                           lifespan="off", access_log=False))
    thread = threading.Thread(target=server.run, name="openai-endpoint", daemon=True)
    thread.start()
    deadline = time.monotonic() + SERVER_START_SECONDS
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the rollout's OpenAI endpoint did not start on {HOST}")
        time.sleep(0.01)
    return server, thread, server.servers[0].sockets[0].getsockname()[1]
