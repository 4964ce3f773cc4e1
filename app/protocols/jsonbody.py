"""JSON request bodies that need a closer look: the exact nesting depth of a body that opens more
arrays and objects than ``RequestLimits.max_json_depth``, and the message for a body msgspec
refused. The decode every JSON request takes is :func:`app.protocols.tensors.decode_json`, which
calls these only then.

The depth is checked *before* decoding, so a hostile body such as ``[[[[...]]]]`` costs a scan,
never a deep recursion: msgspec recurses on nested arrays and gives up with a ``RecursionError``
near Python's recursion limit, and numpy would spend time discovering the dimensions of
whatever it gets. The scan (:func:`check_json_depth`) drops JSON strings (so brackets inside
texts do not count), keeps only the bracket bytes, and tracks the running depth with numpy in
chunks (6 µs for 5 KB, 30 ms for 16 MiB). It does not validate JSON: a malformed body that
passes is refused by the decoder next.

A string holding a lone UTF-16 surrogate (``"\\ud800"`` without its pair) is not text; msgspec
refuses it with a message about the body ("Input data was truncated", "invalid utf-16
surrogate pair"), so the refusal names the field instead (:func:`lone_surrogate`). No aiohttp
here.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import numpy as np

from app.errors import InvalidInput

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


def check_json_depth(body: bytes, limit: int) -> None:
    """Raises ``InvalidInput`` (400) when ``body`` nests arrays/objects deeper than ``limit``."""
    brackets = _brackets(body)
    if len(brackets) > limit and _deepest(brackets, stop_above=limit) > limit:
        raise InvalidInput(
            f"request body nests arrays/objects deeper than {limit} levels (SCORING_MAX_JSON_DEPTH)"
        )


def invalid_json(body: bytes, what: str, exc: msgspec.DecodeError) -> InvalidInput:
    """The 400 for ``body``, which msgspec refused with ``exc``: "invalid {what}: " and msgspec's
    message (it names the JSON path, e.g. ``$.inputs[0].shape``), or the field that holds a
    lone UTF-16 surrogate (:func:`lone_surrogate`)."""
    where = lone_surrogate(body)
    if where is not None:
        return InvalidInput(
            f"invalid {what}: {where} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
            "without its pair), which is not text; send whole characters"
        )
    return InvalidInput(f"invalid {what}: {exc}")


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
