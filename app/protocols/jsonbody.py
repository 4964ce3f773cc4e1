"""JSON request bodies: their nesting depth checked on the raw bytes, then a typed decode.

Nesting depth is checked *before* decoding (``RequestLimits.max_json_depth``), so a hostile body
such as ``[[[[...]]]]`` costs a scan, never a deep recursion: msgspec recurses on nested arrays
and gives up with a ``RecursionError`` near Python's recursion limit, and numpy would spend time
discovering the dimensions of whatever it gets. A body that opens no more arrays and objects
than the limit cannot nest deeper, and most do not (a feed-ranker request of 8 items opens 7):
``bytes.find`` counts them at memchr speed, stopping past the limit (1.2 µs for 5 KB, 22 µs for
1 MB). Only a body with more is scanned: JSON strings dropped (so brackets inside texts do not
count), the bracket bytes kept, the running depth tracked with numpy in chunks (5.6 µs for
5 KB, 4 ms for 1 MB). Neither validates JSON: a malformed body that passes is refused by the
decoder next.

A string holding a lone UTF-16 surrogate (``"\\ud800"`` without its pair) is not text; msgspec
refuses it with a message about the body ("Input data was truncated", "invalid utf-16
surrogate pair"), so the refusal names the field instead (:func:`lone_surrogate`). No aiohttp
here.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

import msgspec
import numpy as np

from app.errors import InvalidInput

T = TypeVar("T")
#: A JSON string, escapes included; possessive, so the scan stays linear on any input.
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_CHUNK = 1 << 20
#: A ``\\uXXXX`` escape of a UTF-16 surrogate (half of a pair, or alone).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _brackets(body: bytes) -> bytes:
    """The bracket bytes of ``body`` outside JSON strings, in order."""
    if b'"' in body:
        body = _STRING.sub(b"", body)
    return body.translate(None, _NOT_BRACKETS)


def _deepest(brackets: bytes, stop_above: int | None = None) -> int:
    deepest = depth = 0
    steps = np.frombuffer(brackets, dtype=np.uint8)
    for start in range(0, len(steps), _CHUNK):
        running = np.cumsum(_STEP[steps[start : start + _CHUNK]], dtype=np.int64) + depth
        deepest = max(deepest, int(running.max()))
        depth = int(running[-1])
        if stop_above is not None and deepest > stop_above:
            break
    return deepest


def _opens_at_most(body: bytes, limit: int) -> bool:
    """Whether ``body`` opens at most ``limit`` arrays and objects in all (inside strings too):
    at most ``limit + 1`` memchr-speed ``find`` calls."""
    left = limit
    for opener in b"[{":
        start = body.find(opener)
        while start >= 0:
            left -= 1
            if left < 0:
                return False
            start = body.find(opener, start + 1)
    return True


def check_json_depth(body: bytes, limit: int) -> None:
    """Raises ``InvalidInput`` (400) when ``body`` nests arrays/objects deeper than ``limit``."""
    if _opens_at_most(body, limit):
        return
    brackets = _brackets(body)
    if len(brackets) > limit and _deepest(brackets, stop_above=limit) > limit:
        raise InvalidInput(
            f"request body nests arrays/objects deeper than {limit} levels (SCORING_MAX_JSON_DEPTH)"
        )


def decode_json(decoder: msgspec.json.Decoder[T], body: bytes, max_depth: int, what: str) -> T:
    """``body`` decoded by ``decoder`` (a msgspec typed decoder), its nesting checked first.

    Raises:
        InvalidInput: nested deeper than ``max_depth``, malformed JSON, invalid UTF-8, or a
            field of the wrong type (the message starts "invalid {what}:" and names the JSON
            path, e.g. ``$.inputs[0].shape``).
    """
    check_json_depth(body, max_depth)
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        where = lone_surrogate(body)
        if where is not None:
            raise InvalidInput(
                f"invalid {what}: {where} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                "without its pair), which is not text; send whole characters"
            ) from None
        raise InvalidInput(f"invalid {what}: {exc}") from None
    except RecursionError:  # only with max_depth near Python's recursion limit
        raise InvalidInput(f"invalid {what}: nested too deeply") from None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # UTF-8 has no surrogates: only a lone one is left in a str
        return True
    return False


def lone_surrogate(body: bytes) -> str | None:
    """The JSON path (``$.input[2]``, msgspec's notation) of the first string or key of ``body``
    that holds a lone UTF-16 surrogate; None when there is none, or ``body`` is not JSON. Only
    for a body msgspec refused: Python's ``json`` module, which reads such strings, parses it
    again (its depth already checked)."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[str, Any]] = [("$", document)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, str) and _has_surrogate(node):
            return path
        if isinstance(node, dict):
            for key, value in reversed(node.items()):
                if _has_surrogate(key):
                    return f"a key of {path}"
                stack.append((f"{path}.{key}", value))
        elif isinstance(node, list):
            stack.extend((f"{path}[{i}]", value) for i, value in reversed(list(enumerate(node))))
    return None
