"""The token ids of a request's prompt, which prefix matching needs.

A completions request whose ``prompt`` is a list of token ids is used as is. Otherwise the
prompt is tokenized by an instance's ``POST /tokenize`` (vLLM's endpoint; chat requests with
their chat-template fields, so the ids are the ones the engine will see). Instances are asked
in turn. A batch prompt (a list of prompts) has no single prefix: no tokens.

Threading: the event loop only. Failure: every method returns None rather than raise.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

__all__ = ["PostJson", "PromptTokens", "tokens_in_body"]

PostJson = Callable[[str, Mapping[str, Any]], Awaitable[tuple[int, bytes]]]
"""POST a JSON body to a URL; returns (status, body), ``(0, b"")`` when the upstream is
unreachable or slow (it never raises for transport failures)."""

_CHAT_FIELDS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "add_special_tokens",
)
_COMPLETION_FIELDS = ("prompt", "add_special_tokens")


def tokens_in_body(body: Mapping[str, Any]) -> list[int] | None:
    """The prompt's token ids when the client sent ids (``prompt: [int, ...]``)."""
    prompt = body.get("prompt")
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    return None


class PromptTokens:
    """Finds prompt token ids, tokenizing through ``urls`` (round-robin) when needed."""

    def __init__(self, post_json: PostJson, urls: Sequence[str]) -> None:
        self._post = post_json
        self._urls = itertools.cycle(urls)

    async def of(self, path: str, body: Mapping[str, Any]) -> list[int] | None:
        ids = tokens_in_body(body)
        if ids is not None:
            return ids
        fields = _CHAT_FIELDS if path.endswith("/chat/completions") else _COMPLETION_FIELDS
        if not isinstance(body.get(fields[0]), (str, list)) or (
            fields is _COMPLETION_FIELDS and not isinstance(body["prompt"], str)
        ):
            return None
        request = {k: body[k] for k in fields if k in body}
        if "model" in body:
            request["model"] = body["model"]
        try:
            status, raw = await self._post(f"{next(self._urls)}/tokenize", request)
            tokens = json.loads(raw).get("tokens") if 200 <= status < 300 else None
        except (ValueError, AttributeError):
            return None
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return tokens
        return None
