"""docs/model-repository.md stays true: its model.toml reference table lists every key of
``ModelConfig`` (and of an input's ``TensorSpec``) with the code's TOML type and default, and
each value it shows as refused is refused with a message naming the key; its handler example,
written into a repository as the doc shows it, is served and answers."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from app.errors import ModelLoadError
from app.models.repository import ModelConfig, TensorSpec, read_config
from tests.support.fixtures import Client, MakeClient
from tests.support.gunicorn import ROOT

DOC = ROOT / "docs" / "model-repository.md"
_TABLE = re.compile(r"<!-- model-toml-reference -->\n(.*?)\n<!-- /model-toml-reference -->", re.S)
#: Set by the loader, never read from the file.
NOT_FROM_THE_FILE = {"path"}

MINIMAL = """\
name = "m"
format = "handler"
handler = "pkg.mod:Cls"
inputs = [{ name = "x", datatype = "FP32", shape = [2] }]
outputs = [{ name = "y", datatype = "FP32", shape = [2] }]
"""


def _rows() -> dict[str, dict[str, str]]:
    match = _TABLE.search(DOC.read_text(encoding="utf-8"))
    assert match, "docs/model-repository.md lost its reference table markers"
    lines = match[1].splitlines()
    header = [c.strip() for c in lines[0].strip("|").split(" | ")]
    rows: dict[str, dict[str, str]] = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == len(header), line
        row = dict(zip(header, cells, strict=True))
        rows[row["Key"].strip("`")] = row
    return rows


def _toml_type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        (inner,) = args
        return _toml_type(inner)
    if origin is typing.Literal or annotation is str:
        return "string"
    if origin is list:
        (item,) = typing.get_args(annotation)
        if isinstance(item, type) and issubclass(item, msgspec.Struct):
            return "array of tables"
        return "array of strings" if item is str else "array of integers"
    if origin is dict or (isinstance(annotation, type) and issubclass(annotation, msgspec.Struct)):
        return "table"
    return {bool: "boolean", int: "integer", float: "float"}[annotation]


def _toml_default(field: msgspec.structs.FieldInfo) -> str:
    if field.required:
        return "required"
    value = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, msgspec.Struct):  # version_policy: the keys that are set
        every = msgspec.structs.asdict(value)
        shown = {k: v for k, v in every.items() if v not in (None, False)} or every
        return "`{ " + ", ".join(f"{k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v in shown.items()) + " }`"
    return f"`{value}`"


def _expected() -> dict[str, tuple[str, str]]:
    hints = typing.get_type_hints(ModelConfig)
    out = {
        f.name: (_toml_type(hints[f.name]), _toml_default(f))
        for f in msgspec.structs.fields(ModelConfig)
        if f.name not in NOT_FROM_THE_FILE
    }
    tensor_hints = typing.get_type_hints(TensorSpec)
    for f in msgspec.structs.fields(TensorSpec):
        out[f"inputs[].{f.name}"] = (_toml_type(tensor_hints[f.name]), _toml_default(f))
    return out


def test_the_reference_lists_every_key_with_the_codes_type_and_default() -> None:
    rows = _rows()
    expected = _expected()
    assert set(rows) == set(expected), f"missing {set(expected) - set(rows)}, extra {set(rows) - set(expected)}"
    for key, (kind, default) in expected.items():
        assert rows[key]["Type"] == kind, key
        assert rows[key]["Default"] == default, key


def _with(snippet: str) -> str:
    """MINIMAL with the snippet's keys set (a cell may set two: ``a = 1; b = 2``)."""
    lines = [part.strip() for part in snippet.split("; ")]
    keys = {line.split("=", 1)[0].strip() for line in lines}
    kept = [line for line in MINIMAL.splitlines() if line.split("=", 1)[0].strip() not in keys]
    return "\n".join([*lines, *kept]) + "\n"


def test_the_minimal_model_toml_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "model.toml").write_text(MINIMAL)
    assert read_config(tmp_path).name == "m"


@pytest.mark.parametrize(("key", "snippet"), [(k, r["Refused, e.g."].strip("`")) for k, r in _rows().items()])
def test_each_value_the_reference_refuses_is_refused_naming_the_key(key: str, snippet: str, tmp_path: Path) -> None:
    (tmp_path / "model.toml").write_text(_with(snippet))
    with pytest.raises(ModelLoadError) as info:
        read_config(tmp_path)
    top = key.split("[", 1)[0]
    message = str(info.value)
    assert message.startswith(f"{tmp_path.name}/model.toml") or f"model {top}" in message, message
    assert top.rstrip("s") in message, message


def test_an_unknown_key_is_refused(tmp_path: Path) -> None:
    """The upgrade note: a key this release does not know is refused, never ignored."""
    (tmp_path / "model.toml").write_text(_with("max_batch = 8"))
    with pytest.raises(ModelLoadError, match="unknown field `max_batch`"):
        read_config(tmp_path)


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)


async def test_the_handler_example_is_served(make_client: MakeClient, tmp_path: Path) -> None:
    (toml,) = _blocks("toml")
    (handler,) = _blocks("python")
    folder = tmp_path / "my-repository" / "doubler"
    folder.mkdir(parents=True)
    (folder / "model.toml").write_text(toml)
    (folder / "doubler.py").write_text(handler)
    client: Client = await make_client(folder.parent)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4], "data": [1, 2, 3, 4, 5, 6, 7, 8]}]}
    resp = await client.post("/v2/models/doubler/infer", json=body)
    assert resp.status == 200, await resp.text()
    (out,) = (await resp.json())["outputs"]
    assert out["name"] == "y" and out["shape"] == [2, 4]
    assert out["data"] == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0]
