"""Log configuration for gunicorn's ``logconfig_dict``: text or JSON lines, one setting apart.

``gunicorn.conf.py`` passes :func:`log_config` as ``logconfig_dict``; gunicorn
applies it with ``logging.config.dictConfig`` in the master, and the forked
workers inherit it. It configures the ``gunicorn.error``, ``gunicorn.access``,
``app`` and ``gpu_stat`` loggers (everything else reaches the root logger at
WARNING), so the workers' ``app.serving.lifecycle`` "model ready" and "worker ready"
lines appear next to gunicorn's own.

``SCORING_LOG_FORMAT=json`` writes one JSON object per line::

    {"ts": "2025-01-31T12:00:00.123Z", "level": "INFO", "logger": "app.serving.lifecycle",
     "pid": 4242, "message": "worker 4242 ready: ...", "event": "worker_ready", ...}

Fields passed with ``extra=`` become keys. Access lines (aiohttp's access logger
passes every atom of the format as an extra) get ``remote``, ``request``,
``status``, ``bytes``, ``latency_s`` (the event loop's clock: 1 ms steps under
uvloop), ``request_id`` and ``duration_ms`` (the app's time, from the
``Server-Timing`` response header, microsecond precise).

This module imports neither torch nor prometheus_client: the master loads it.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
from typing import Any, Literal

from gunicorn.glogging import CONFIG_DEFAULTS

_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
#: aiohttp access-log atoms (web_log.AccessLogger.FORMAT_MAPPING) -> JSON keys and types.
_ACCESS_FIELDS: dict[str, tuple[str, type]] = {
    "remote_address": ("remote", str),
    "first_request_line": ("request", str),
    "response_status": ("status", int),
    "response_size": ("bytes", int),
    "request_time_frac": ("latency_s", float),
    "request_time_micro": ("latency_us", int),
    "request_time": ("latency_s", float),
    "request_start_time": ("start", str),
}
TEXT_FORMAT = "%(asctime)s [%(process)d] [%(levelname)s] %(name)s: %(message)s"
ACCESS_TEXT_FORMAT = "%(asctime)s [%(process)d] [ACCESS] %(message)s"
DATE_FORMAT = "[%Y-%m-%d %H:%M:%S %z]"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ms), level, logger, pid, message, extras, exc_info."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        out: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key in _RESERVED or key.startswith("_"):
                continue
            if key in _ACCESS_FIELDS:
                name, kind = _ACCESS_FIELDS[key]
                out[name] = _convert(value, kind)
            elif key in ("response_header", "request_header") and isinstance(value, dict):
                for header, header_value in value.items():
                    out.update(_header_field(header, header_value))
            else:
                out[key] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def _header_field(header: str, value: str) -> dict[str, Any]:
    """``X-Request-Id`` -> request_id; ``Server-Timing: app;dur=1.5`` -> duration_ms=1.5."""
    name = header.lower()
    if name == "x-request-id":
        return {"request_id": value}
    if name == "server-timing":
        for part in value.split(";"):
            key, _, number = part.strip().partition("=")
            if key == "dur":
                return {"duration_ms": _convert(number, float)}
    return {name: value}


def _convert(value: Any, kind: type) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError):
        return value  # "-" for a missing figure


def _text_formatter(fmt: str) -> dict[str, str]:
    return {"format": fmt, "datefmt": DATE_FORMAT, "class": "logging.Formatter"}


def log_config(
    log_format: Literal["text", "json"],
    level: str,
    access_log: str | None = "-",
) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` dict: gunicorn's ``CONFIG_DEFAULTS`` plus our loggers.

    Args:
        log_format: "text" (gunicorn's style, with the logger name) or "json".
        level: level name of the server's own loggers (``gunicorn.error``, ``app``, ``gpu_stat``).
        access_log: "-" for stdout, a file path, or None/"" (access lines then never come:
            gunicorn's aiohttp worker only logs them when ``accesslog`` is set).
    """
    level = level.upper()
    json_lines = log_format == "json"
    text = "json" if json_lines else "text"
    access_formatter = "json" if json_lines else "access_text"
    access_handler: dict[str, Any] = (
        {"class": "logging.FileHandler", "filename": access_log, "formatter": access_formatter}
        if access_log and access_log != "-"
        else {"class": "logging.StreamHandler", "stream": "ext://sys.stdout", "formatter": access_formatter}
    )
    ours = {
        "formatters": {
            "generic": _text_formatter(TEXT_FORMAT),
            "text": _text_formatter(TEXT_FORMAT),
            "access_text": _text_formatter(ACCESS_TEXT_FORMAT),
            "json": {"()": f"{__name__}.JsonFormatter"},
        },
        "handlers": {
            "console": {"class": "logging.StreamHandler", "formatter": text, "stream": "ext://sys.stdout"},
            "error_console": {"class": "logging.StreamHandler", "formatter": text, "stream": "ext://sys.stderr"},
            "access": access_handler,
        },
        "loggers": {
            "gunicorn.error": {"level": level, "handlers": ["error_console"], "propagate": False},
            "gunicorn.access": {"level": "INFO", "handlers": ["access"], "propagate": False},
            "app": {"level": level, "handlers": ["error_console"], "propagate": False},
            "gpu_stat": {"level": level, "handlers": ["error_console"], "propagate": False},
        },
        # Libraries (torch, transformers, asyncio) log warnings and errors in the same format.
        "root": {"level": "WARNING", "handlers": ["error_console"]},
    }
    config: dict[str, Any] = copy.deepcopy(CONFIG_DEFAULTS)
    for section in ("formatters", "handlers", "loggers"):
        config.setdefault(section, {}).update(ours[section])
    config["root"] = ours["root"]
    config["disable_existing_loggers"] = False
    return config
