"""What the chat endpoint reads from an OpenAI chat-completions request: which requests it refuses,
and how request messages are compared and handed to the chat template.

Why this module exists
----------------------
Clients (the SDK, openai-agents, LangChain) send the episode's history back in their own
spelling: tool calls with JSON-text arguments and ids of their own, content as a list of parts or
None. Whether a message is one the endpoint answered earlier (`signature`), how it is rendered
(`template_message`) and which request fields are refused (`UNSUPPORTED`) follow the OpenAI
format and change with it, apart from the server and the chaining of token ids
(openai_endpoint.py). Pure: json only.
"""

from __future__ import annotations

import json

UNSUPPORTED = {
    "n": (lambda value: value not in (None, 1),
          "one choice per request: each completion is one sampled turn of the episode"),
    "stream": (lambda value: bool(value), "answers come whole; streaming is not supported"),
    "top_logprobs": (lambda value: bool(value),
                     "only the sampled token's log-prob is known (logprobs=true)"),
    "stop": (lambda value: bool(value),
             "stop strings would end a turn inside a token; the chat template's end-of-turn "
             "token ends it"),
    "tool_choice": (lambda value: value not in (None, "auto"),
                    "the model chooses its tools (\"auto\"); forcing a choice is not supported"),
    "response_format": (lambda value: value not in (None, {"type": "text"}),
                        "structured output would constrain sampling; not supported"),
    "logit_bias": (lambda value: bool(value), "would change the sampled distribution"),
    "presence_penalty": (lambda value: bool(value), "would change the sampled distribution"),
    "frequency_penalty": (lambda value: bool(value), "would change the sampled distribution"),
}
"""Request fields the endpoint refuses (HTTP 400) when set: (is it set?, why not)."""



def signature(message: dict) -> tuple:
    """What two messages must share to be the same message: role, text (None as ""), and the
    tool calls by name and parsed arguments (ids and other fields ignored)."""
    calls = tuple((call["function"]["name"],
                   _arguments_text(call["function"].get("arguments", {})))
                  for call in message.get("tool_calls") or ())
    return message.get("role"), _text(message.get("content")), calls


def template_message(message: dict) -> dict:
    """A request message as chat templates take it: text content, tool calls with their
    arguments as objects (Hugging Face's convention), and the name fields kept."""
    plain = {"role": message["role"], "content": _text(message.get("content"))}
    for name in ("name", "tool_call_id"):
        if message.get(name) is not None:
            plain[name] = message[name]
    if message.get("tool_calls"):
        plain["tool_calls"] = [{"type": "function", "function": {
            "name": call["function"]["name"],
            "arguments": _arguments(call["function"].get("arguments", {}))}}
            for call in message["tool_calls"]]
    return plain


def _tools_key(tools: list[dict] | None) -> str:
    return json.dumps(tools, sort_keys=True)


def _text(content) -> str:
    """Message content as text (None: empty; a list of parts: their texts joined)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content)
    return content


def _arguments(arguments):
    """Tool call arguments as an object where they parse (the SDK sends JSON text)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _arguments_text(arguments) -> str:
    return json.dumps(_arguments(arguments), sort_keys=True)


def _unsupported(body) -> str | None:
    """Why the endpoint refuses this request (None: it does not)."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or \
            not body["messages"]:
        return "messages: a non-empty list of messages is required"
    for index, message in enumerate(body["messages"]):
        problem = _message_problem(message)
        if problem:
            return f"messages[{index}]: {problem}"
    for name, (is_set, reason) in UNSUPPORTED.items():
        if is_set(body.get(name)):
            return f"{name}={body[name]!r} is not supported here: {reason}"
    return None


def _message_problem(message) -> str | None:
    """What makes a request message unreadable (None: nothing)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return "a message must be an object with a \"role\" string"
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list) or not all(
            isinstance(call, dict) and isinstance(call.get("function"), dict)
            and isinstance(call["function"].get("name"), str) for call in calls):
        return "tool_calls must be a list of {\"function\": {\"name\", \"arguments\"}}"
    return None
