"""The shape of the source the project keeps: no function in ``app/`` or ``gpu_stat/`` over 80
lines (generated gRPC stubs aside), so that each reads on one screen."""

from __future__ import annotations

import ast

from tests.support.gunicorn import ROOT

MAX_LINES = 80


def test_no_function_is_longer_than_80_lines() -> None:
    long = []
    for folder in ("app", "gpu_stat"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "generated" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > MAX_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
