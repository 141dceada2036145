"""The foreign APIs `kvtool serve` answers, by POST path (`kvtool.server.apis`).

`TRANSLATIONS` maps a route to its `ApiTranslation` (answered on the chat-completions path);
`COUNTERS` maps a token-count route to its `TokenCounter` (answered on the handler's thread).
"""

from __future__ import annotations

from kvtool.server.api_messages import MessagesApi
from kvtool.server.api_responses import ResponsesApi
from kvtool.server.apis import ApiTranslation, TokenCounter

_MESSAGES = MessagesApi()

TRANSLATIONS: dict[str, ApiTranslation] = {api.route: api for api in (_MESSAGES, ResponsesApi())}
COUNTERS: dict[str, TokenCounter] = {_MESSAGES.route + "/count_tokens": _MESSAGES}


def lookup(path: str) -> tuple[ApiTranslation | None, TokenCounter | None]:
    """`(translation, counter)` of a POST path; its query string is ignored (the SDKs' beta
    clients, and so Claude Code, post to `/v1/messages?beta=true`)."""
    route = path.split("?", 1)[0]
    return TRANSLATIONS.get(route), COUNTERS.get(route)


__all__ = ["TRANSLATIONS", "COUNTERS", "lookup"]
