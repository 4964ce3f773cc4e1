"""Model repository: a folder with one subfolder per model.

Each model folder holds its weights and a ``model.toml``::

    model_repository/
      feed-ranker/
        model.toml        # name, version, format, inputs/outputs, batching, warmup
        model.pt2
      feed-ranker-onnx/
        model.toml        # format = "onnx": an ONNX graph run by ONNX Runtime
        model.onnx
      all-MiniLM-L6-v2/
        model.toml        # format = "handler", handler = "module:Class"

Tensor shapes in ``model.toml`` are *per item*: the batch dimension is implied
(as in Triton's ``config.pbtxt`` with ``max_batch_size > 0``); ``-1`` marks a
variable dimension. README.md ("Model repository") documents every field.

One broken model never stops the others: :func:`scan` returns the models it could read and,
apart, the folders it could not, each with its reason (Triton's UNAVAILABLE model state).
Reasons name files relative to the repository (:func:`scrub_paths`): they are shown by
readiness and the repository index, which must not disclose the server's file system.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from app.datatypes import DATATYPES, NUMPY_DTYPES
from app.errors import ModelLoadError

CONFIG_FILE = "model.toml"
ModelFormat = Literal["torch_export", "torchscript", "onnx", "handler"]
#: A model name or version: a safe single path component.
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
#: ``module:Class``, the module a dotted name (no path tricks: it may name a file in the folder).
_HANDLER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")

#: V2 ``platform`` reported in model metadata for each format.
PLATFORMS: dict[str, str] = {
    "torch_export": "pytorch_torch_export",
    "torchscript": "pytorch_libtorch",
    "onnx": "onnxruntime_onnx",
    "handler": "python_handler",
}


class TensorSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One input or output tensor: V2 datatype and per-item shape (batch dim excluded)."""

    name: str
    datatype: str
    shape: list[int]
    optional: bool = False
    #: A classifier's label per value of the last axis, in order (Triton's ``label_filename``
    #: inline): Triton's classification extension and the classify API name labels from it.
    labels: list[str] | None = None
    #: An output whose first per-item dimension differs from item to item (declared ``-1``): a
    #: ragged output, e.g. one row per token (multi-vector embeddings) or one entry per non-zero
    #: term (sparse embeddings). A handler returns it as B arrays ``[n_i, *shape[1:]]`` of the
    #: declared datatype (a list, or an object array ``[B]``); the server carries it as an
    #: object array ``[B]`` of those arrays, and each protocol encodes it as its docs say
    #: (docs/model-repository.md, *Ragged outputs*).
    ragged: bool = False
    #: An input shared by a request's items (a feed request's user, beside its N candidates):
    #: sent once, batch dimension 1 (or B, repeated, as without it). ``"repeat"``: the model sees
    #: it repeated for each item; ``"once"``: a handler sees
    #: its distinct rows in batch order and, under ``app.models.base.shared_rows(name)``, each
    #: item's row (docs/model-repository.md, *Inputs shared by a request's items*).
    shared: Literal["repeat", "once"] | None = None

    def filled(self, batch_size: int, *, text: bytes = b"", variable_dim: int = 1) -> np.ndarray:
        """A ``[batch_size, *shape]`` array of zeros, or of ``text`` for BYTES; -1 dims become
        ``variable_dim``. Used for omitted optional inputs and for warmup batches."""
        shape = (batch_size, *(variable_dim if d == -1 else d for d in self.shape))
        if self.datatype == "BYTES":
            arr = np.empty(shape, dtype=object)
            arr.fill(text)
            return arr
        return np.zeros(shape, dtype=NUMPY_DTYPES[self.datatype])

    def validate(self, where: str) -> None:
        """Raises ``ModelLoadError`` naming ``where`` if the spec is malformed."""
        if self.datatype not in DATATYPES:
            raise ModelLoadError(f"{where}: datatype {self.datatype!r} is not one of {sorted(DATATYPES)}")
        if any(d == 0 or d < -1 for d in self.shape):
            raise ModelLoadError(f"{where}: shape {self.shape} has a dimension that is not -1 or > 0")
        if self.ragged and (not self.shape or self.shape[0] != -1 or -1 in self.shape[1:]):
            raise ModelLoadError(
                f"{where}: a ragged output's shape starts with -1 (the length that differs per item) "
                f"and has no other -1, e.g. [-1, 128]; got {self.shape}"
            )


class VersionPolicy(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Which versions of a model serve (Triton's ``version_policy``): exactly one of ``latest``
    (the N highest), ``specific`` (these versions) and ``all``. Default: the latest one."""

    latest: int | None = None
    specific: list[str] | None = None
    all: bool = False

    def validate(self, where: str) -> None:
        """Raises ``ModelLoadError`` unless exactly one kind is given, and sanely."""
        given = [self.latest is not None, self.specific is not None, self.all]
        if sum(given) != 1:
            raise ModelLoadError(
                f"{where}: version_policy needs exactly one of latest = N, specific = [...], all = true"
            )
        if self.latest is not None and self.latest < 1:
            raise ModelLoadError(f"{where}: version_policy latest must be >= 1")
        if self.specific is not None and not self.specific:
            raise ModelLoadError(f"{where}: version_policy specific must name at least one version")

    def select(self, versions: list[str]) -> list[str]:
        """The versions of ``versions`` that serve, in version order."""
        ordered = sorted(versions, key=version_key)
        if self.all:
            return ordered
        if self.specific is not None:
            return [v for v in ordered if v in self.specific]
        return ordered[-(self.latest or 1) :]


class ResponseCacheConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A model's ``[response_cache]`` (Triton's name): ``enable = true`` caches its outputs per
    item in the host's store (``app.serving.response_cache``; the store's size, place and TTL are
    server settings). Only for a model whose outputs for an item depend on that item alone
    (not on its batch mates, the time, or randomness): docs/response-cache.md."""

    enable: bool = False


def version_key(version: str) -> tuple[int, Any]:
    """Sort key of a version: numbers numerically, before other names."""
    return (0, int(version)) if version.isdigit() else (1, version)


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A model's ``model.toml``, validated.

    Units: ``max_queue_delay_ms``, ``timeout_ms`` (the default deadline) and
    ``max_timeout_ms`` (the cap on a client's deadline; None = the server's
    ``max_request_timeout_ms``) in milliseconds, ``queue_capacity`` in items (rows),
    ``max_batch_size`` in items, ``max_batch_bytes`` (the most input bytes in one batch;
    None = the server's ``max_batch_bytes``) in bytes, ``max_batch_tokens`` in the cost unit
    of the handler's ``item_costs`` (tokens), padding included.
    """

    name: str
    version: str = "1"
    format: ModelFormat
    file: str | None = None
    handler: str | None = None
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch_size: int = 32
    max_queue_delay_ms: float = 2.0
    #: Event-loop turns a partial batch waits, after the max queue delay, for requests already
    #: on their way (app.serving.queue.RequestQueue); 0 = none.
    gather_turns: int = 32
    #: The longest a partial batch gathers, whatever the load, ms.
    gather_max_ms: float = 2.0
    queue_capacity: int = 1024
    timeout_ms: float | None = None
    max_timeout_ms: float | None = None
    max_batch_bytes: int | None = None
    #: Most tokens in one batch, padding included (items x the longest item's cost), for a
    #: handler that prices its items (``item_costs``); None = no bound (TEI's name).
    max_batch_tokens: int | None = None
    #: The staged pipeline (prepare / forward / finish on three threads): "on", "off", or
    #: "auto" = on for a CUDA device, off on the CPU (where the stages share the same cores).
    pipeline: Literal["auto", "on", "off"] = "auto"
    #: Threads that run ``item_costs`` and ``preprocess``; 0 = 1 on the CPU, else 2.
    prepare_threads: int = 0
    warmup_batch_sizes: list[int] = msgspec.field(default_factory=lambda: [1])
    #: Batch sizes (ascending, each <= ``max_batch_size``) at which a ``torch_export`` or
    #: ``torchscript`` model on a CUDA device is captured as one CUDA graph each at load; a
    #: batch runs as the graph of the smallest size that holds it, padded with zeros. Empty =
    #: off; ignored on the CPU (``app.models.torch_formats.GraphBuckets``). A handler that
    #: captures graphs (the text handlers: strings per forward call, with token buckets of
    #: their own, ``app.handlers.text_graphs``) reads it too; other handlers refuse it at load.
    cuda_graph_batch_sizes: list[int] = msgspec.field(default_factory=list)
    allow_non_finite: bool = False
    #: Admission policy (app.serving.admission): "measured_rate" (admission by time at the
    #: measured rate) or "capacity" (queue capacity plus deadline, as TEI and Triton's queue policy).
    admission: Literal["measured_rate", "capacity"] = "measured_rate"
    #: measured_rate: admit a request only if it is expected to finish within this share of its
    #: time to deadline (docs/reliability.md, *Overload*: 0.6 gave 504s, 0.4 low goodput).
    admission_headroom: float = 0.5
    #: Triton's priority levels: 0 = one queue (a request's priority is ignored); N = levels 1
    #: (the highest) .. N, batched highest first and admitted against their own backlog.
    priority_levels: int = 0
    #: The level of a request that names no priority (0 = the lowest level, N).
    default_priority_level: int = 0
    #: A waiting request of a lower level goes before every level once it has waited this share
    #: of its time to deadline (aging: no level starves); above ``admission_headroom``, so that
    #: only requests pushed back by higher levels age.
    priority_aging: float = 0.75
    #: Lower levels join a batch holding higher-level items only while they add at most this
    #: share to its expected time (measured rate); ``inf``: Triton's fill, whatever it costs.
    priority_fill: float = 0.25
    #: Split a request with more than ``max_batch_size`` items into shards that run in
    #: parallel on this worker and its ready siblings (scatter/gather; app.server.router).
    scatter: bool = True
    #: Which versions of the model serve (Triton's); read from its highest version's folder.
    version_policy: VersionPolicy = msgspec.field(default_factory=lambda: VersionPolicy(latest=1))
    #: Per-item results cached in the host's store (``[response_cache] enable = true``).
    response_cache: ResponseCacheConfig = msgspec.field(default_factory=ResponseCacheConfig)
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)
    #: The model's folder; set by the loader, not read from the file.
    path: Path = Path(".")

    @property
    def platform(self) -> str:
        """The V2 metadata ``platform`` string for this model's format."""
        return PLATFORMS[self.format]

    def input(self, name: str) -> TensorSpec | None:
        """The input spec called ``name``, or None."""
        return next((s for s in self.inputs if s.name == name), None)

    @property
    def where(self) -> str:
        """This model's ``model.toml`` as named in messages: ``<folder>/model.toml``."""
        return f"{self.path.name}/{CONFIG_FILE}"

    def weights_path(self) -> Path:
        """``file`` inside the model's folder.

        Raises:
            ModelLoadError: no ``file``, or one that leads out of the folder (``..``, an
                absolute path, a link to elsewhere).
        """
        if not self.file:
            raise ModelLoadError(f"{self.where}: format {self.format!r} needs file = '<weights file>'")
        folder = self.path.resolve()
        path = (folder / self.file).resolve()
        if not path.is_relative_to(folder):
            raise ModelLoadError(f"{self.where}: file {self.file!r} must be inside the model's folder")
        return path

    def validate(self) -> None:
        """Cross-field checks; raises ``ModelLoadError`` with the file and field named."""
        where = self.where
        if not _NAME.match(self.name) or self.name in (".", ".."):
            raise ModelLoadError(
                f"{where}: name {self.name!r} must be 1-128 of letters, digits, '.', '_', '-'"
            )
        if self.version and not _NAME.match(self.version):
            raise ModelLoadError(f"{where}: version {self.version!r} must be letters, digits, '.', '_', '-'")
        if not self.inputs or not self.outputs:
            raise ModelLoadError(f"{where}: a model needs at least one input and one output")
        for kind, specs in (("inputs", self.inputs), ("outputs", self.outputs)):
            names = [s.name for s in specs]
            if len(set(names)) != len(names):
                raise ModelLoadError(f"{where}: duplicate names in {kind}: {names}")
            reserved = [n for n in names if not n or n.startswith("#")]
            if reserved:  # "#..." is the server's own (app.models.base.PREPARED)
                raise ModelLoadError(f"{where}: {kind} names must not be empty or start with '#': {reserved}")
            for s in specs:
                s.validate(f"{where} {kind}.{s.name}")
                if kind == "inputs" and s.ragged:
                    raise ModelLoadError(f"{where} inputs.{s.name}: ragged applies to outputs only")
                if kind == "outputs" and s.shared is not None:
                    raise ModelLoadError(f"{where} outputs.{s.name}: shared applies to inputs only")
        if self.format == "handler":
            if not self.handler or not _HANDLER.match(self.handler):
                raise ModelLoadError(
                    f"{where}: format 'handler' needs handler = 'module:Class' (a dotted module name)"
                )
        else:
            self.weights_path()
        once = [s.name for s in self.inputs if s.shared == "once"]
        if once and self.format != "handler":
            raise ModelLoadError(
                f"{where}: inputs {once} are shared = \"once\", which only a handler takes; a "
                f"{self.format} model takes every input per item: shared = \"repeat\""
            )
        if self.max_batch_size < 1:
            raise ModelLoadError(f"{where}: max_batch_size must be >= 1")
        if self.max_queue_delay_ms < 0:
            raise ModelLoadError(f"{where}: max_queue_delay_ms must be >= 0")
        if self.gather_turns < 0:
            raise ModelLoadError(f"{where}: gather_turns must be >= 0")
        if not 0 <= self.gather_max_ms < float("inf"):
            raise ModelLoadError(f"{where}: gather_max_ms must be a finite number >= 0")
        if not 0 < self.admission_headroom <= 1:
            raise ModelLoadError(f"{where}: admission_headroom must lie in (0, 1]")
        if not 0 < self.priority_aging <= 1:
            raise ModelLoadError(f"{where}: priority_aging must lie in (0, 1]")
        if not self.priority_fill >= 0:
            raise ModelLoadError(f"{where}: priority_fill must be >= 0 (inf: no bound)")
        if self.priority_levels < 0 or not 0 <= self.default_priority_level <= self.priority_levels:
            raise ModelLoadError(
                f"{where}: priority_levels must be >= 0 and default_priority_level in 0..priority_levels"
            )
        if self.queue_capacity < self.max_batch_size:
            raise ModelLoadError(f"{where}: queue_capacity must be >= max_batch_size")
        if self.prepare_threads < 0:
            raise ModelLoadError(f"{where}: prepare_threads must be >= 0")
        for key in ("timeout_ms", "max_timeout_ms", "max_batch_bytes", "max_batch_tokens"):
            value = getattr(self, key)
            if value is not None and not 0 < value < float("inf"):
                raise ModelLoadError(f"{where}: {key} must be a finite number > 0")
        self.version_policy.validate(where)
        if any(b < 1 or b > self.max_batch_size for b in self.warmup_batch_sizes):
            raise ModelLoadError(f"{where}: warmup_batch_sizes must lie in 1..max_batch_size")
        self._validate_cuda_graphs()

    def _validate_cuda_graphs(self) -> None:
        sizes = self.cuda_graph_batch_sizes
        if not sizes:
            return
        where = f"{self.where}: cuda_graph_batch_sizes"
        if self.format not in ("torch_export", "torchscript", "handler"):
            raise ModelLoadError(
                f"{where} applies to torch_export and torchscript models and the text handlers, "
                f"not {self.format} models"
            )
        if sizes != sorted(set(sizes)):
            raise ModelLoadError(f"{where} must be ascending without repeats, e.g. [1, 2, 4, 8], got {sizes}")
        if sizes[0] < 1 or sizes[-1] > self.max_batch_size:
            raise ModelLoadError(
                f"{where} must lie in 1..max_batch_size ({self.max_batch_size}), got {sizes}"
            )
        variable = [s.name for s in self.inputs if -1 in s.shape]
        if variable and self.format != "handler":
            raise ModelLoadError(
                f"{where}: a CUDA graph replays fixed shapes, but inputs {variable} have a variable (-1) "
                "dimension"
            )


def read_config(model_dir: Path) -> ModelConfig:
    """Parse and validate ``model_dir/model.toml``.

    Raises:
        ModelLoadError: missing file, TOML syntax error, unknown or mistyped field, or a value
            that fails validation (the message names ``<folder>/model.toml``).
    """
    path = model_dir / CONFIG_FILE
    where = f"{model_dir.name}/{CONFIG_FILE}"
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{where}: not found") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{where}: {exc}") from exc
    try:
        config = msgspec.convert(raw, ModelConfig)
    except msgspec.ValidationError as exc:
        raise ModelLoadError(f"{where}: {exc}") from exc
    config.path = model_dir.resolve()
    config.validate()
    return config


@dataclass(frozen=True)
class Unavailable:
    """A model folder that could not be served, and why (no absolute paths in ``reason``)."""

    name: str
    reason: str
    version: str = ""


@dataclass(frozen=True)
class Scan:
    """What :func:`scan` found: the models it could read, and the folders it could not."""

    configs: list[ModelConfig]
    unavailable: list[Unavailable]


def declared_name(folder: Path) -> tuple[str | None, str]:
    """The ``name`` and ``version`` that ``folder``'s ``model.toml`` declares even though it
    fails validation: (None, "") when it cannot be parsed or names no valid model name."""
    try:
        raw = tomllib.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None, ""
    name, version = raw.get("name"), str(raw.get("version", "1"))
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
        return None, ""
    return name, version if _NAME.match(version) else ""


def scan(repository: Path, names: tuple[str, ...] = ()) -> Scan:
    """Read the config of every model folder in ``repository`` (or only those of ``names``).

    A folder whose ``model.toml`` cannot be read or fails validation, and every folder of a
    model version declared twice, is listed as unavailable with its reason (by the model name
    its ``model.toml`` declares, else by folder name); the others are returned.

    Raises:
        ModelLoadError: the repository is missing or holds no model folder at all, or a
            model named in ``names`` is in no folder.
    """
    if not repository.is_dir():
        raise ModelLoadError(f"model repository {repository} is not a directory")
    folders = [d for d in sorted(repository.iterdir()) if (d / CONFIG_FILE).is_file()]
    if not folders:
        raise ModelLoadError(f"model repository {repository} holds no folder with a {CONFIG_FILE}")
    configs: list[ModelConfig] = []
    unavailable: list[Unavailable] = []
    for folder in folders:
        try:
            configs.append(read_config(folder))
        except ModelLoadError as exc:
            name, version = declared_name(folder)
            unavailable.append(Unavailable(name or folder.name, scrub_paths(str(exc), repository), version))
    if names:
        known = {c.name for c in configs} | {u.name for u in unavailable}
        missing = set(names) - known
        if missing:
            raise ModelLoadError(
                f"model(s) {sorted(missing)} not in repository {repository} (found {sorted(known)})"
            )
        configs = [c for c in configs if c.name in names]
        unavailable = [u for u in unavailable if u.name in names]
    declared: dict[tuple[str, str], list[ModelConfig]] = {}
    for c in configs:
        declared.setdefault((c.name, c.version), []).append(c)
    for (name, version), same in declared.items():
        if len(same) > 1:
            folders_named = ", ".join(c.path.name for c in same)
            reason = f"model {name} version {version} is declared by several folders ({folders_named})"
            unavailable.append(Unavailable(name, reason, version))
    return Scan([c for c in configs if len(declared[(c.name, c.version)]) == 1], unavailable)


def fingerprint(folder: Path) -> str:
    """What identifies the content of a model version's folder: the name, size and modification
    time of every file in it (recursively), hashed. A copied, edited or replaced file changes it
    (model control reloads the version); reading it costs one ``stat`` per file."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            stat = path.stat()
            digest.update(f"{path.relative_to(folder)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def serving(found: Scan) -> Scan:
    """What serves of ``found``: per model, the versions its ``version_policy`` selects (the
    policy of its highest version's ``model.toml``)."""
    by_name: dict[str, list[ModelConfig]] = {}
    for config in found.configs:
        by_name.setdefault(config.name, []).append(config)
    kept: list[ModelConfig] = []
    for configs in by_name.values():
        newest = max(configs, key=lambda c: version_key(c.version))
        chosen = set(newest.version_policy.select([c.version for c in configs]))
        kept += [c for c in configs if c.version in chosen]
    return Scan(kept, found.unavailable)


#: An absolute path (a run of non-space characters starting with "/").
_ABSOLUTE = re.compile(r"(?<![\w.])/[^\s'\"(),:]+")


def scrub_paths(text: str, repository: Path) -> str:
    """``text`` with the server's file system hidden: paths inside ``repository`` made
    relative to it, any other absolute path reduced to ``…/<last component>``."""
    for root in {str(repository), str(repository.resolve())}:
        text = text.replace(root.rstrip("/") + "/", "")
    return _ABSOLUTE.sub(lambda m: "…/" + m.group(0).rstrip("/").rsplit("/", 1)[-1], text)
