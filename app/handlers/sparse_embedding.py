"""Sparse embeddings (SPLADE, inference-free SPLADE) from a sentence-transformers ``SparseEncoder``
folder: one weight per vocabulary term a text activates, for an inverted index beside a dense one.

``SparseEmbeddingHandler`` serves the folders :mod:`app.handlers.splade` reads, equal to the
library's ``SparseEncoder.encode`` / ``encode_query`` / ``encode_document`` on the same folder
(``tests/unit/test_sparse_embedding.py``: within 1e-5, float32), with the server's contract:
tokenized once when the request is priced (:mod:`app.handlers.tokenizing`), batched in length
groups, long texts cut or in windows.

Inputs (per item):

``text``  BYTES, required
    UTF-8 text to embed.
``input_type``  INT64, optional
    1 a query, 2 a document, 0 or omitted the folder's default route (``encode``; an
    inference-free model's documents' route): which of the folder's routes and prompts the text
    takes (:data:`app.handlers.text_config.INPUT_TYPE`).
``truncate_prompt_tokens``  INT64, optional (:mod:`app.handlers.text_config`).

Outputs (``model.toml`` declares them; ``indices`` and ``values`` ragged, shape ``[-1]``):

``indices`` INT64, ragged ``[n_i]``
    The vocabulary ids of the text's non-zero terms, ascending (``n_i`` differs per text).
``values`` FP32, ragged ``[n_i]``
    Their weights, in the same order.
``tokens`` INT64 ``[1]``, ``windows`` INT64 ``[1]``
    As :mod:`app.handlers.sentence_embedding`'s.

Every non-zero term is returned: the top-k and threshold a client may ask are the protocol's
(:mod:`app.protocols.sparse`), applied to the whole text's vector, so a long text in windows is
pruned once its windows are merged, and one cached vector answers every cut.

**Long texts.** ``truncation = "truncate"`` by default (cut at ``max_seq_length``); with
``"window"`` a text's vector is the element-wise maximum of its windows' (the sum for a
``"sum"`` pooling): SPLADE's max over the whole text's tokens, each token seen in the context of
its window (:func:`app.models.windows.sparse`). A text on a static route (the query side of an
inference-free model) in windows is the weights of the terms of all its windows.

``[parameters]``: those of :mod:`app.handlers.text_config` (``max_seq_length`` defaults to the
encoder's ``sentence_bert_config.json`` or tokenizer) and the window parameters of
:mod:`app.models.windows`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from app.datatypes import ragged
from app.handlers.embedding_pipeline import takes_type_ids
from app.handlers.folder_json import read_json_object
from app.handlers.splade import (
    MaskedLM,
    SparsePlan,
    SpladeRoute,
    StaticWeights,
    load_masked_lm,
    nonzero_rows,
    read_folder,
)
from app.handlers.text_base import TextHandler, max_length, model_kwargs, prepared_parts
from app.handlers.text_config import (
    INPUT_TYPES,
    SHARED_PARAMETERS,
    TRUNCATE,
    ModelConfigLike,
    check_ragged_output,
    check_shared_parameters,
    declares_truncation,
    decode_texts,
    input_types,
    item_integers,
    resolve_model_dir,
)
from app.handlers.tokenizing import Ids, Parts, TextTokenizer, Window
from app.models import windows as windowing

__all__ = ["SparseBatch", "SparseEmbeddingHandler", "SparseOutputs"]

_PARAMETERS = (*SHARED_PARAMETERS, *windowing.PARAMETERS)
#: What ``postprocess`` returns.
_OUTPUTS = ("indices", "values", "tokens", "windows")
#: A window's preparation names no route: the item's ``input_type`` decides (:meth:`_resolved`).
_UNRESOLVED = np.array([-1], dtype=np.int32)


@dataclass(frozen=True)
class SparseBatch:
    """``preprocess`` output.

    Attributes:
        groups: the SPLADE route's items, one forward call per length group: the model's inputs,
            int64 ``[U_g, T_g]`` on the device.
        indices: on the device: ``position`` int64 ``[S]`` (the row of the groups' rows,
            concatenated, of each SPLADE item in item order); per static route r, ``rows_r``
            and ``ids_r`` (int64: its items' rows and the terms they hold); ``gather`` int64
            ``[B]`` (item b's row among the SPLADE rows then each static route's).
        static: the static routes' item counts, by route index.
        tokens: int64 ``[B]`` on the host, each text's tokens.
    """

    groups: list[dict[str, torch.Tensor]]
    indices: dict[str, torch.Tensor]
    static: dict[int, int]
    tokens: npt.NDArray[np.int64]


@dataclass(frozen=True)
class SparseOutputs:
    """``predict`` output: each item's vector ``[B, V]`` (float32, on the device) and its tokens."""

    vectors: torch.Tensor
    tokens: npt.NDArray[np.int64]


class SparseEmbeddingHandler(TextHandler):
    """Sparse vectors of texts (module docstring).

    An item's preparation is ``(ids, route)``: its token ids as its route runs them (the
    encoder's, special tokens included; a static route's, without) and its route's index
    (int32 ``[1]``; -1 for a window, whose route its ``input_type`` gives once it is priced).
    """

    kind = "SparseEmbeddingHandler"
    #: What runs after the layers, for the memory plan (``app.models.memory.declared_head``): the
    #: masked-LM head's vocabulary-wide logits, pooled a chunk of tokens at a time
    #: (:data:`app.handlers.splade.LOGITS_BYTES`).
    MEMORY_HEAD = "lm-chunked"

    def __init__(self) -> None:
        super().__init__()
        self.plan: SparsePlan | None = None
        #: Route index -> its model: the SPLADE transformer, or a static embedding.
        self.routes: list[MaskedLM | StaticWeights] = []
        self._names: list[str] = []
        self._prompts: dict[str, str] = {}

    @property
    def encoder(self) -> MaskedLM:
        """The SPLADE route's transformer."""
        found = next((r for r in self.routes if isinstance(r, MaskedLM)), None)
        if found is None:
            raise RuntimeError(f"{self.kind}.load() has not been called")
        return found

    @property
    def vocab_size(self) -> int:
        """V, the vocabulary the ids index."""
        return self.encoder.vocab_size

    def load(self, device: torch.device, config: ModelConfigLike) -> None:
        """Load the folder named in ``config.parameters`` onto ``device``, from local files only;
        then measure the cost model (:meth:`TextHandler.calibrate`) unless ``model.toml`` fixes it.

        Raises:
            ValueError: bad or unknown parameters; a folder that is not a SPLADE pipeline
                (:func:`app.handlers.splade.read_folder`); outputs not declared as served; a
                ``max_seq_length`` over the model's limit; a non-empty prompt where texts may be
                cut or split.
            FileNotFoundError: a missing folder.
        """
        parameters = dict(config.parameters)
        check_shared_parameters(config.name, self.kind, parameters, _PARAMETERS)
        folder = resolve_model_dir(parameters, config.path)
        plan = read_folder(folder)
        splade = next((r for r in plan.routes.values() if isinstance(r, SpladeRoute)), None)
        if splade is None:
            raise ValueError(
                f"{folder}: no SPLADE encoder among its routes; nothing to tokenize windows with"
            )
        encoder = load_masked_lm(splade, device, model_kwargs(parameters))
        routes = [
            encoder if isinstance(r, SpladeRoute) else StaticWeights(r, device) for r in plan.routes.values()
        ]
        limit = getattr(encoder.config, "max_position_embeddings", None)
        settings = read_json_object(splade.folder / "sentence_bert_config.json")
        folder_default = settings.get("max_seq_length") or TextTokenizer.model_max_length(splade.folder)
        length = max_length(parameters, folder_default, limit)
        policy = windowing.WindowPolicy.from_parameters(parameters, length, default_truncation="truncate")
        self.truncates = declares_truncation(config)
        cuts = policy.truncation != "truncate" or self.truncates
        prompts = {task: plan.prompt(task) for task in INPUT_TYPES}
        if cuts and any(prompts.values()):
            raise ValueError(
                f'the folder\'s prompts {prompts} need truncation = "truncate" and no truncate_prompt_tokens '
                "input: a cut or a split would separate a prompt from its text"
            )
        self._tokenizer = TextTokenizer.from_folder(
            splade.folder, length, stride=policy.overflow_stride,
            lowercase=bool(settings.get("do_lower_case", False)), pairs=False, keeps_last=self.truncates,
        )  # fmt: skip
        merge = "sparse_max" if splade.strategy == "max" else "sparse_sum"
        self.policy = policy
        self.type_ids = takes_type_ids(encoder.encoder)
        self.merge_rules = windowing.merges(
            _OUTPUTS, policy, {"indices": merge, "values": merge, "tokens": "sum", "windows": "sum"}
        )
        for name, datatype in (("indices", "INT64"), ("values", "FP32")):
            check_ragged_output(config, name, datatype, [-1], "one entry per non-zero term")
        self.set_device(device)
        self.plan, self.routes, self._names, self._prompts = plan, routes, list(plan.routes), prompts
        self.calibrate(parameters, encoder)

    def close(self) -> None:
        """Drop the routes' models, then :meth:`TextHandler.close`."""
        self.routes, self.plan = [], None
        super().close()

    # --- preparations ---------------------------------------------------------------------------

    def window_parts(self, window: Window, extra: Ids | None) -> Parts:
        """A window's ``(its encoder ids, -1)``: its route is its item's ``input_type``'s."""
        return (window.ids, _UNRESOLVED)

    def item_parts(self, inputs: Mapping[str, npt.NDArray[Any]]) -> list[Parts]:
        """Each item's ``(ids, route)`` (class docstring): from ``inputs[PREPARED]`` where it
        holds the item's route; a window's (route -1) resolved by its ``input_type``, its text
        tokenized again only for a static route; the others tokenized here.

        Raises:
            ValueError: ``text`` missing, invalid UTF-8, a wrong shape, an unknown
                ``input_type``, a bad ``truncate_prompt_tokens``.
        """
        given = prepared_parts(inputs)
        if given is not None and all(p is not None and int(p[1][0]) >= 0 for p in given):
            return given  # type: ignore[return-value]
        plan = self._plan
        count = len(given) if given is not None else len(np.asarray(inputs.get("text", ())).reshape(-1))
        tasks = input_types(inputs, count)
        routes = [self._names.index(plan.route(task)) for task in tasks]
        out: list[Parts | None] = [None] * count
        for i, parts in enumerate(given or [None] * count):
            if parts is not None and (int(parts[1][0]) >= 0 or isinstance(self.routes[routes[i]], MaskedLM)):
                out[i] = (parts[0], np.array([routes[i]], dtype=np.int32)) if int(parts[1][0]) < 0 else parts
        missing = [i for i, p in enumerate(out) if p is None]
        if missing:
            if "text" not in inputs:
                raise ValueError("required input 'text' is missing")
            texts = decode_texts("text", np.asarray(inputs["text"]))
            for i, ids in zip(missing, self._tokenize(texts, tasks, routes, inputs, missing), strict=True):
                out[i] = (ids, np.array([routes[i]], dtype=np.int32))
        return out  # type: ignore[return-value]

    @property
    def _plan(self) -> SparsePlan:
        if self.plan is None:
            raise RuntimeError(f"{self.kind}.load() has not been called")
        return self.plan

    def _tokenize(
        self,
        texts: Sequence[str],
        tasks: Sequence[str],
        routes: Sequence[int],
        inputs: Mapping[str, npt.NDArray[Any]],
        items: Sequence[int],
    ) -> list[Ids]:
        """The ids of ``items`` (indices into ``texts``), each as its route runs it: the encoder's
        tokenizer after the task's prompt (cut to its last tokens where ``truncate_prompt_tokens``
        asks: :meth:`TextHandler.kept_windows`), or a static route's."""
        raw = item_integers(inputs, TRUNCATE, len(texts)) if self.truncates else None
        keep = self.keep(inputs, len(texts)) if raw is not None else None
        out: dict[int, Ids] = {}
        encoded = [i for i in items if isinstance(self.routes[routes[i]], MaskedLM)]
        cut = self.kept_windows(
            [texts[i] for i in encoded], None, [keep[i] for i in encoded] if keep else None
        )
        whole = [i for k, i in enumerate(encoded) if k not in cut]
        out.update({encoded[k]: w.ids for k, w in cut.items()})
        if whole:
            prompted = [self._prompts[tasks[i]] + texts[i] for i in whole]
            out.update(zip(whole, self.tokenizer.encode(prompted), strict=True))
        for route, model in enumerate(self.routes):
            static = [i for i in items if routes[i] == route and i not in out]
            if static and isinstance(model, StaticWeights):
                wanted = [int(raw[i]) for i in static] if raw is not None else None
                prompted = [self._prompts[tasks[i]] + texts[i] for i in static]
                out.update(zip(static, model.encode(prompted, wanted), strict=True))
        return [out[i] for i in items]

    # --- per batch ----------------------------------------------------------------------------

    def preprocess(self, inputs: Mapping[str, npt.NDArray[Any]]) -> SparseBatch:
        """The items' preparations (``inputs[PREPARED]``; tokenized here only where absent) on
        the device: the SPLADE route's in length groups (:meth:`TextHandler.batch_cost`'s cost
        model), each static route's as (row, term) pairs.

        Raises:
            ValueError: as :meth:`item_parts`.
        """
        parts = self.item_parts(inputs)
        routes = np.fromiter((int(p[1][0]) for p in parts), dtype=np.int64, count=len(parts))
        tokens = np.fromiter((len(p[0]) for p in parts), dtype=np.int64, count=len(parts))
        encoded = [i for i, r in enumerate(routes) if isinstance(self.routes[r], MaskedLM)]
        lengths = tokens[encoded]
        groups = self.cost.groups(lengths) if encoded else []
        position = np.empty(len(encoded), dtype=np.int64)
        if encoded:
            position[np.concatenate(groups)] = np.arange(len(encoded))
        indices: dict[str, npt.NDArray[np.int64]] = {"position": position}
        order = list(encoded)
        static: dict[int, int] = {}
        for route, model in enumerate(self.routes):
            items = [i for i in range(len(parts)) if routes[i] == route and isinstance(model, StaticWeights)]
            if not items:
                continue
            ids = [np.unique(parts[i][0]).astype(np.int64) for i in items]
            indices[f"rows_{route}"] = np.repeat(np.arange(len(items)), [len(x) for x in ids])
            indices[f"ids_{route}"] = np.concatenate(ids) if ids else np.zeros(0, np.int64)
            static[route] = len(items)
            order.extend(items)
        gather = np.empty(len(parts), dtype=np.int64)
        gather[np.asarray(order, dtype=np.int64)] = np.arange(len(order))
        indices["gather"] = gather
        rows = [[parts[encoded[i]][0] for i in g] for g in groups]
        *features, placed = self.features(rows, indices=indices)
        return SparseBatch(features, placed, static, tokens)

    def predict(self, batch: SparseBatch) -> SparseOutputs:
        """The SPLADE vectors of the encoded items (one call per length group) and each static
        route's (the weights of the terms each text holds), in item order."""
        parts = []
        if batch.groups:
            pooled = [self.encoder(dict(group)) for group in batch.groups]
            parts.append((pooled[0] if len(pooled) == 1 else torch.cat(pooled))[batch.indices["position"]])
        for route, count in batch.static.items():
            model = self.routes[route]
            assert isinstance(model, StaticWeights)
            rows, ids = batch.indices[f"rows_{route}"], batch.indices[f"ids_{route}"]
            presence = torch.zeros(count, len(model.weight), dtype=torch.int64, device=ids.device)
            presence[rows, ids] = 1
            parts.append((presence * model.weight).float())
        vectors = parts[0] if len(parts) == 1 else torch.cat(parts)
        return SparseOutputs(vectors[batch.indices["gather"]], batch.tokens)

    def postprocess(self, outputs: SparseOutputs) -> dict[str, npt.NDArray[Any]]:
        """``{"indices": ragged int64 [n_i], "values": ragged float32 [n_i], "tokens": int64
        [B, 1], "windows": int64 [B, 1]}`` on the host: each vector's non-zero terms, ids
        ascending (``windows``: 1 each; the window stage sums them per text)."""
        ids, values = nonzero_rows(outputs.vectors.to("cpu", torch.float32).numpy())
        return {
            "indices": ragged(ids),
            "values": ragged(values),
            "tokens": outputs.tokens.reshape(-1, 1),
            "windows": np.ones((len(outputs.tokens), 1), dtype=np.int64),
        }
