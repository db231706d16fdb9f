"""A client's mistake as the OpenAI server answers it: `RequestError` (status 400 unless said,
naming the field it is about), and the helpers that name a field in a message."""

from __future__ import annotations

import re
from typing import Any, Optional

Json = dict[str, Any]


class RequestError(ValueError):
    """A client mistake: the message names the field; `param` is the field's name (by default
    the field the message starts with: "logprobs: at most ...")."""

    def __init__(
        self,
        message: str,
        param: Optional[str] = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.param = param if param is not None else field_of(message)
        self.status = status
        self.kind = kind


# "name: ...", "name.sub[0]: ...", "name + other: ...": the field a message is about
_FIELD = re.compile(r"([a-z_][a-z0-9_]*)(?:[.\[][^\s:]*)?(?: \+ [a-z_][\w.]*)*: ")


def field_of(message: str) -> Optional[str]:
    """The request field a message starts with, if it starts with one."""
    m = _FIELD.match(message)
    return m.group(1) if m else None


def renamed(error: str, names: dict[str, str]) -> str:
    """An engine error about one of its fields (SamplingParams' names) in the request's own names
    (chat's "top_logprobs" is the engine's "logprobs")."""
    name = field_of(error)
    if name in names:
        return names[name] + error[len(name) :]
    return error


def refused(field: str, why: str) -> RequestError:
    """The 400 of a field this server does not honour."""
    return RequestError(f"{field}: {why}", field)
