"""Small models for tests: a tensor model exported to .pt2 / TorchScript, a controllable
handler that records what it sees (batch sizes, items), and models broken in every way an
operator can break one (with the check that what is reported of them names no absolute path)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import numpy as np
import torch

from app.models.repository import ModelConfig, TensorSpec

SCALE_TOML = """
name = "{name}"
version = "{version}"
format = "handler"
handler = "tests.support.toy_models:ScaleHandler"
max_batch_size = {max_batch_size}
max_queue_delay_ms = {max_queue_delay_ms}
queue_capacity = {queue_capacity}
warmup_batch_sizes = [1]
[[inputs]]
name = "x"
datatype = "FP32"
shape = [2]
[[inputs]]
name = "tag"
datatype = "BYTES"
shape = [1]
optional = true
[[outputs]]
name = "y"
datatype = "FP32"
shape = [2]
[[outputs]]
name = "tag_length"
datatype = "INT64"
shape = [1]
[parameters]
{parameters}
"""


class ScaleHandler:
    """y = factor * x (``factor``: 2 unless the parameter says); tag_length = len(tag). Records
    every batch it sees (class-wide, per model).

    parameters: ``factor``, ``load_gate`` (name of an Event in ``GATES`` that load waits for),
    ``load_delay_s``, ``fail_load_if_exists`` (a path: load raises while it exists),
    ``refuse`` (load raises ValueError with this reason, as a handler refusing its config does),
    ``oom_on_load`` (load raises torch.OutOfMemoryError, as a full GPU does),
    ``crash_on_load`` (the worker process SIGKILLs itself while loading),
    ``delay_ms`` per batch (not for warmup batches, whose tags all start with ``b"warmup"``: those
    sleep ``warmup_delay_ms``, so admission's seed rate is fast unless that is given),
    ``fail_on`` (x value that raises), ``oom_on`` (x value that raises torch.OutOfMemoryError:
    one item that does not fit even alone), ``hang_on`` (x value that
    makes the batch sleep ``hang_s`` seconds, default 3600, or with ``hang_gate``, wait until
    that Event of ``GATES`` is set), ``oom_above`` (batches larger
    than this raise torch.OutOfMemoryError).
    """

    BATCHES: ClassVar[dict[str, list[list[float]]]] = {}
    GATES: ClassVar[dict[str, threading.Event]] = {}
    #: How many times each model's load was tried.
    LOADS: ClassVar[dict[str, int]] = {}

    def load(self, device: torch.device, config: Any) -> None:
        self.name = config.name
        self.params = dict(config.parameters)
        self.LOADS[self.name] = self.LOADS.get(self.name, 0) + 1
        if self.params.get("refuse"):
            raise ValueError(self.params["refuse"])
        gate = self.params.get("load_gate")
        if gate:
            assert self.GATES[gate].wait(30)
        time.sleep(float(self.params.get("load_delay_s", 0)))
        marker = self.params.get("fail_load_if_exists")
        if marker and Path(marker).exists():
            raise RuntimeError(f"simulated load failure ({marker} exists)")
        if self.params.get("oom_on_load"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        if self.params.get("crash_on_load"):  # a native crash: the process dies at once
            os.kill(os.getpid(), signal.SIGKILL)
        self.BATCHES[self.name] = []

    def preprocess(self, inputs: Mapping[str, np.ndarray]) -> tuple[torch.Tensor, np.ndarray]:
        return torch.from_numpy(inputs["x"]), inputs["tag"].reshape(-1)

    def predict(self, batch: tuple[torch.Tensor, np.ndarray]) -> tuple[torch.Tensor, np.ndarray]:
        x, tags = batch
        self.BATCHES[self.name].append(x[:, 0].tolist())
        if "oom_above" in self.params and len(x) > int(self.params["oom_above"]):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        if "oom_on" in self.params and bool((x == float(self.params["oom_on"])).any()):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated, x = oom_on)")
        if "fail_on" in self.params and bool((x == float(self.params["fail_on"])).any()):
            raise RuntimeError("simulated model failure")
        if "hang_on" in self.params and bool((x == float(self.params["hang_on"])).any()):
            gate = self.params.get("hang_gate")
            if gate:
                assert self.GATES[gate].wait(60)
            else:
                time.sleep(float(self.params.get("hang_s", 3600)))
        warmup = len(tags) > 0 and all(bytes(t).startswith(b"warmup") for t in tags)
        time.sleep(float(self.params.get("warmup_delay_ms" if warmup else "delay_ms", 0)) / 1000)
        return x * float(self.params.get("factor", 2)), tags

    def postprocess(self, outputs: tuple[torch.Tensor, np.ndarray]) -> dict[str, np.ndarray]:
        y, tags = outputs
        return {
            "y": y.numpy(),
            "tag_length": np.array([[len(t)] for t in tags], dtype=np.int64),
        }


def write_scale_model(
    repo: Path,
    name: str = "scale",
    *,
    max_batch_size: int = 8,
    max_queue_delay_ms: float = 5.0,
    queue_capacity: int = 64,
    version: str = "1",
    folder_name: str | None = None,
    response_cache: bool = False,
    **parameters: Any,
) -> Path:
    """Write a ScaleHandler model folder into ``repo`` (``folder_name``, default ``name``: one
    folder per version; ``response_cache``: with ``[response_cache] enable = true``); returns
    the folder."""
    folder = repo / (folder_name or name)
    folder.mkdir(parents=True, exist_ok=True)
    params = "\n".join(
        f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"' for k, v in parameters.items()
    )
    (folder / "model.toml").write_text(
        SCALE_TOML.format(
            name=name,
            version=version,
            max_batch_size=max_batch_size,
            max_queue_delay_ms=max_queue_delay_ms,
            queue_capacity=queue_capacity,
            parameters=params,
        )
        + ("\n[response_cache]\nenable = true\n" if response_cache else "")
    )
    return folder


def unit_config(name: str = "m", **fields: Any) -> ModelConfig:
    """The config of a model with input ``x`` FP32 [2] and output ``y`` FP32 [2], for a serving
    unit built in a test: ``fields`` (``ModelConfig``'s: bounds, admission, priority levels)
    over ``gather_turns = 0`` (a partial batch closes at its delay: batch compositions the tests
    can count)."""
    spec = [TensorSpec("x", "FP32", [2])], [TensorSpec("y", "FP32", [2])]
    return ModelConfig(
        name=name, format="handler", handler="tests.support.toy_models:ScaleHandler", inputs=spec[0],
        outputs=spec[1], **({"gather_turns": 0} | fields),
    )  # fmt: skip


class TinyRanker(torch.nn.Module):
    """features FP32 [B, 4] -> probability FP32 [B, 1]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.linear(features))


TENSOR_TOML = """
name = "{name}"
version = "1"
format = "{fmt}"
file = "{file}"
max_batch_size = 16
max_queue_delay_ms = 1.0
warmup_batch_sizes = [1, 16]
[[inputs]]
name = "features"
datatype = "FP32"
shape = [4]
[[outputs]]
name = "probability"
datatype = "FP32"
shape = [1]
"""


def write_tensor_model(repo: Path, name: str, fmt: str) -> TinyRanker:
    """Export TinyRanker to ``repo/name`` as ``torch_export`` (.pt2) or ``torchscript`` (.pt)."""
    folder = repo / name
    folder.mkdir(parents=True, exist_ok=True)
    model = TinyRanker().eval()
    if fmt == "torch_export":
        file = "model.pt2"
        batch = torch.export.Dim("batch", min=1, max=1024)
        program = torch.export.export(model, (torch.zeros(2, 4),), dynamic_shapes={"features": {0: batch}})
        torch.export.save(program, str(folder / file))
    else:
        file = "model.pt"
        torch.jit.save(torch.jit.script(model), str(folder / file))
    (folder / "model.toml").write_text(TENSOR_TOML.format(name=name, fmt=fmt, file=file))
    return model


def write_broken_models(repo: Path) -> dict[str, str]:
    """Write one model folder per way a careless operator breaks a model into ``repo``; returns
    the name each is reported under -> a piece of the reason it is reported with."""
    expected: dict[str, str] = {}

    def scale(folder: str, replace: tuple[str, str] = ("", ""), name: str | None = None) -> Path:
        path = write_scale_model(repo, folder)
        text = (path / "model.toml").read_text()
        if name is not None:
            text = text.replace(f'name = "{folder}"', f'name = "{name}"')
        (path / "model.toml").write_text(text.replace(*replace) if replace[0] else text)
        return path

    scale("syntax", ("max_batch_size =", "max_batch_size = = "))
    expected["syntax"] = "syntax/model.toml"
    scale("pathlike", name="../../escape")
    expected["pathlike"] = "must be 1-128 of letters"
    scale("twin-a", name="twin")
    scale("twin-b", name="twin")
    expected["twin"] = "declared by several folders (twin-a, twin-b)"
    scale("no-import", ("tests.support.toy_models:ScaleHandler", "local_handler:Handler"))
    (repo / "no-import" / "local_handler.py").write_text("import a_module_that_does_not_exist\n")
    expected["no-import/1"] = "cannot import handler"
    scale("raises-on-import", ("tests.support.toy_models:ScaleHandler", "local_handler:Handler"))
    (repo / "raises-on-import" / "local_handler.py").write_text("raise RuntimeError('broken on import')\n")
    expected["raises-on-import/1"] = "broken on import"
    for folder, problem in (
        ("missing-weights", "missing"),
        ("truncated-weights", "truncated"),
        ("escape", ".."),
    ):
        path = repo / folder
        path.mkdir(parents=True)
        file = "../../../etc/hostname" if problem == ".." else "model.pt2"
        if problem == "truncated":
            (path / file).write_bytes(b"PK\x03\x04 not a whole archive")
        (path / "model.toml").write_text(TENSOR_TOML.format(name=folder, fmt="torch_export", file=file))
    expected["missing-weights/1"] = "weights file missing-weights/model.pt2 not found"
    expected["truncated-weights/1"] = "cannot load truncated-weights/model.pt2"
    expected["escape"] = "must be inside the model's folder"
    return expected


def assert_no_absolute_paths(text: str, repo: Path) -> None:
    """``text`` (what a client or a log gets about the broken models of ``repo``) names no
    absolute path: neither the repository's nor a system folder's."""
    assert str(repo) not in text and str(repo.resolve()) not in text, text
    assert "/tmp/" not in text and "/root/" not in text and "/work/" not in text, text


EMBED_TOML = """
name = "{name}"
version = "1"
format = "handler"
handler = "tests.support.toy_models:EmbedHandler"
max_batch_size = 8
max_queue_delay_ms = 1.0
[[inputs]]
name = "text"
datatype = "BYTES"
shape = [1]
[[outputs]]
name = "embedding"
datatype = "FP32"
shape = [4]
[[outputs]]
name = "tokens"
datatype = "INT64"
shape = [1]
"""


class EmbedHandler:
    """A text embedding model double: ``embedding`` FP32 [4], a unit vector made from the text's
    bytes; ``tokens`` INT64 [1], its number of words. Refuses a text that is not UTF-8."""

    def load(self, device: torch.device, config: Any) -> None:
        gate = dict(config.parameters).get("load_gate")  # the name of an Event in ScaleHandler.GATES
        if gate:
            assert ScaleHandler.GATES[gate].wait(30)

    def preprocess(self, inputs: Mapping[str, np.ndarray]) -> list[str]:
        return [bytes(t).decode("utf-8") for t in inputs["text"].reshape(-1)]

    def predict(self, texts: list[str]) -> list[str]:
        return texts

    def postprocess(self, texts: list[str]) -> dict[str, np.ndarray]:
        vectors = np.array(
            [[len(t) + 1, sum(map(ord, t)) % 97 + 1, t.count(" ") + 1, 1.0] for t in texts], np.float32
        )
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        return {"embedding": vectors, "tokens": np.array([[len(t.split())] for t in texts], dtype=np.int64)}


def write_embed_model(repo: Path, name: str = "embed", load_gate: str = "") -> Path:
    """Write an EmbedHandler model folder into ``repo`` (``load_gate``: its load waits for that
    Event of ``ScaleHandler.GATES``); returns the folder."""
    folder = repo / name
    folder.mkdir(parents=True, exist_ok=True)
    gate = f'[parameters]\nload_gate = "{load_gate}"\n' if load_gate else ""
    (folder / "model.toml").write_text(EMBED_TOML.format(name=name) + gate)
    return folder


def write_handler_toml(
    repo: Path, name: str, handler: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], **fields: Any
) -> Path:
    """A model folder ``repo/name`` whose ``model.toml`` serves ``handler`` (``module:Class``)
    with these tensors (each spec's fields that differ from their defaults written out) and
    ``fields`` (``max_batch_size = 8``, ``max_queue_delay_ms = 2.0`` unless given); returns it."""

    def value(v: Any) -> str:  # TOML: strings, numbers and lists as JSON writes them
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return str(v).lower() if isinstance(v, bool) else json.dumps(v)

    lines = [f'name = "{name}"', 'format = "handler"', f'handler = "{handler}"']
    lines += [f"{k} = {value(v)}" for k, v in ({"max_batch_size": 8, "max_queue_delay_ms": 2.0} | fields).items()]
    for kind, specs in (("inputs", inputs), ("outputs", outputs)):
        for spec in specs:
            lines.append(f"[[{kind}]]")
            lines += [f"{k} = {value(v)}" for k, v in msgspec.structs.asdict(spec).items()
                      if v != getattr(TensorSpec("", "", []), k) or k in ("name", "datatype", "shape")]  # fmt: skip
    folder = repo / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.toml").write_text("\n".join(lines) + "\n")
    return folder


class NonzeroRowsHandler:
    """A model with a variable input and a ragged output: item ``x`` (FP32 ``[n]``, n the same
    for a request's items) -> ``rows`` (FP32 ``[k, 2]``, one row ``[v, 2 v]`` per non-zero
    ``v`` of ``x``: k differs per item) and ``count`` (k). Records every batch's shape."""

    SHAPES: ClassVar[list[tuple[int, ...]]] = []

    def load(self, device: torch.device, config: Any) -> None:
        pass

    def preprocess(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        return inputs["x"]

    def predict(self, x: np.ndarray) -> list[np.ndarray]:
        self.SHAPES.append(x.shape)
        return [np.stack([row[row != 0], 2 * row[row != 0]], axis=1) for row in x]

    def postprocess(self, rows: list[np.ndarray]) -> dict[str, Any]:
        return {"rows": rows, "count": np.array([[len(r)] for r in rows], dtype=np.int64)}

    @staticmethod
    def expected(x: Sequence[float]) -> np.ndarray:
        v = np.asarray([value for value in x if value != 0], np.float32)
        return np.stack([v, 2 * v], axis=1).reshape(-1, 2)


def write_ragged_model(repo: Path, name: str = "ragged", response_cache: bool = False) -> Path:
    """A :class:`NonzeroRowsHandler` model folder in ``repo``: ``x`` FP32 ``[-1]`` in, ``rows``
    FP32 ``[-1, 2]`` (ragged) and ``count`` INT64 ``[1]`` out."""
    return write_handler_toml(
        repo, name, "tests.support.toy_models:NonzeroRowsHandler", [TensorSpec("x", "FP32", [-1])],
        [TensorSpec("rows", "FP32", [-1, 2], ragged=True), TensorSpec("count", "INT64", [1])],
        **({"response_cache": {"enable": True}} if response_cache else {}),
    )  # fmt: skip
