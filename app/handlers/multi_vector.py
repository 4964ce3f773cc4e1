"""Multi-vector embeddings (ColBERT, late interaction) from a PyLate folder: one normalised vector
per token of a text, and the MaxSim relevance of a document to a query.

``MultiVectorHandler`` serves the folders :mod:`app.handlers.colbert` reads, equal to PyLate's
``ColBERT.encode(is_query=...)`` and ``colbert_scores`` on the same folder
(``tests/unit/test_multi_vector.py``: within 1e-5, float32), with the server's contract:
tokenized once when the request is priced, each distinct string (a rerank request's query)
encoded once per batch, length groups, long documents cut or in windows.

Inputs (per item):

``text``  BYTES, required
    UTF-8 text to embed: a document (its marker, its punctuation rows dropped) or, where
    ``input_type`` says so, a query (its marker, expanded with mask tokens to ``query_length``).
``query``  BYTES, optional
    A query to score the text against, as a document (MaxSim); empty: no score.
``input_type``  INT64, optional
    1 a query, 2 a document; 0 or omitted: a document (the bulk of what an index embeds; PyLate's
    own ``encode`` takes queries by default, ``is_query=True``).
``truncate_prompt_tokens``  INT64, optional (:mod:`app.handlers.text_config`; documents only:
    a query is cut at ``query_length``, as PyLate cuts it).

Outputs:

``embedding`` FP32, ragged ``[n_i, dim]`` (declared ``shape = [-1, dim]``, ``ragged = true``)
    The text's rows, in token order, each of unit L2 norm.
``score`` FP32 ``[1]``
    MaxSim of the item's ``query`` (encoded as a query) against its text (as a document); 0.0
    without a query.
``tokens`` INT64 ``[1]``, ``windows`` INT64 ``[1]``
    The tokens the text ran (marker and expansion included); the windows it took.

**Long documents.** ``truncation = "truncate"`` by default: cut at ``max_seq_length`` tokens
(default the folder's ``document_length``, the marker included), as PyLate cuts them. With
``"window"`` a document's rows are its windows' rows one after the other, in order
(:func:`app.models.windows.rows`), each window encoded with its own ``[CLS]``, marker and
``[SEP]``. ``stride`` defaults to 0 here: a token a window repeats from the one before would
come back twice, once in each window's context (MaxSim keeps the better of the two, the answer
is longer by that many rows); a model.toml that sets a stride gets exactly that. A long
document's ``score`` is its best window's MaxSim (``aggregate = "max"``: MaxP, as the server's
other rerankers score long documents), not MaxSim over all its windows' rows at once, which the
client can compute from ``embedding``. A query is never split: past ``query_length`` its
tokens are dropped (PyLate's truncation), so of a query in windows only the first counts.

``[parameters]``: those of :mod:`app.handlers.text_config` and the window parameters of
:mod:`app.models.windows`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from app.datatypes import ragged
from app.handlers.colbert import ColbertPlan, DenseChain, load_dense, maxsim, read_folder
from app.handlers.embedding_pipeline import load_encoder, takes_type_ids
from app.handlers.text_base import TextHandler, max_length, model_kwargs, prepared_parts
from app.handlers.text_config import (
    SHARED_PARAMETERS,
    ModelConfigLike,
    check_ragged_output,
    check_shared_parameters,
    declares_truncation,
    input_types,
    resolve_model_dir,
    text_inputs,
)
from app.handlers.tokenizing import (
    Ids,
    Parts,
    TextTokenizer,
    Window,
    load_tokenizer,
    prepared_array,
    special_token,
)
from app.models import windows as windowing
from app.models.base import Priced

__all__ = ["MultiVectorBatch", "MultiVectorHandler", "MultiVectorOutputs"]

_PARAMETERS = (*SHARED_PARAMETERS, *windowing.PARAMETERS)
_OUTPUTS = ("embedding", "score", "tokens", "windows")
_NONE: Ids = np.zeros(0, dtype=np.int32)
#: An item's kind (its preparation's ``info[0]``): a window's is its ``input_type``'s, once priced.
DOCUMENT, QUERY, UNRESOLVED = 0, 1, -1


def _info(kind: int, start: int) -> Ids:
    return np.array([kind, start], dtype=np.int32)


@dataclass(frozen=True)
class MultiVectorBatch:
    """``preprocess`` output: each distinct string (text or query) of the batch once.

    Attributes:
        groups: one forward call each: ``input_ids`` (and ``token_type_ids``), int64
            ``[U_g, T_g]`` on the device (``attention_mask``: made in ``predict`` from
            ``attended``).
        indices: on the device, each int64 ``[U]`` over the groups' rows concatenated:
            ``attended`` (tokens attended to), ``length`` (tokens run: a query's expansion
            included), ``document`` (1: a document's row, whose punctuation is dropped); and
            ``scored_text``, ``scored_query`` ``[S]``: the rows of each scored item's text and query.
        text: int64 ``[B]`` on the host, the row of each item's text (-1: no rows).
        scored: int64 ``[S]`` on the host, the items with a query.
        tokens: int64 ``[B]`` on the host, the tokens each text ran.
    """

    groups: list[dict[str, torch.Tensor]]
    indices: dict[str, torch.Tensor]
    text: npt.NDArray[np.int64]
    scored: npt.NDArray[np.int64]
    tokens: npt.NDArray[np.int64]


@dataclass(frozen=True)
class MultiVectorOutputs:
    """``predict`` output: every distinct string's rows ``[U, T, dim]`` (float32, unit norm) and
    which are kept ``[U, T]`` (on the device), the items' scores ``[B]``, and the host's indices."""

    rows: torch.Tensor
    keep: torch.Tensor
    score: torch.Tensor
    text: npt.NDArray[np.int64]
    tokens: npt.NDArray[np.int64]


class MultiVectorHandler(TextHandler):
    """ColBERT's token vectors and MaxSim scores (module docstring).

    An item's preparation is ``(text ids, query ids, info)``: the text's ids as the model runs
    them before expansion (the marker inserted), its ``query``'s as a query's (empty: none), and
    int32 ``[kind, start]`` (:data:`DOCUMENT`, :data:`QUERY`, or :data:`UNRESOLVED` for a window
    not yet priced; ``start``: the window's first character).
    """

    kind = "MultiVectorHandler"

    def __init__(self) -> None:
        super().__init__()
        self.plan: ColbertPlan | None = None
        self.dense: DenseChain | None = None
        self._queries: TextTokenizer | None = None
        self._markers: dict[int, int | None] = {}
        self._mask_id = 0
        self._skiplist = torch.zeros(0, dtype=torch.int64)

    @property
    def embedding_dim(self) -> int:
        """The width of a row."""
        if self.dense is None:
            raise RuntimeError(f"{self.kind}.load() has not been called")
        return self.dense.out_features

    @property
    def _plan(self) -> ColbertPlan:
        if self.plan is None:
            raise RuntimeError(f"{self.kind}.load() has not been called")
        return self.plan

    def load(self, device: torch.device, config: ModelConfigLike) -> None:
        """Load the PyLate folder named in ``config.parameters`` onto ``device``, from local files
        only; then measure the cost model unless ``model.toml`` fixes it.

        Raises:
            ValueError: bad or unknown parameters; not a PyLate ColBERT folder
                (:func:`app.handlers.colbert.read_folder`); a default prompt (not served);
                outputs not declared as served; a ``max_seq_length`` over the model's limit.
            FileNotFoundError: a missing folder.
        """
        parameters = dict(config.parameters)
        check_shared_parameters(config.name, self.kind, parameters, _PARAMETERS)
        folder = resolve_model_dir(parameters, config.path)
        plan = read_folder(folder)
        if plan.default_prompt:
            raise ValueError(f"{folder}: a default prompt ({plan.default_prompt!r}) is not served")
        kwargs = model_kwargs(parameters)
        encoder = load_encoder(folder, device, kwargs)
        dense = load_dense(plan.dense, kwargs["dtype"], device)
        limit = getattr(encoder.config, "max_position_embeddings", None)
        length = max_length(parameters, plan.document_length, limit, minimum=3)
        vocabulary = load_tokenizer(folder)  # ids of the markers and special tokens, looked up once
        markers = {
            DOCUMENT: _token_id(vocabulary, plan.document_prefix, folder),
            QUERY: _token_id(vocabulary, plan.query_prefix, folder),
        }
        policy = windowing.WindowPolicy.from_parameters(
            {"stride": 0, **parameters},
            length - (markers[DOCUMENT] is not None),
            default_truncation="truncate",
        )
        self.truncates = declares_truncation(config)
        self._tokenizer = TextTokenizer.from_folder(
            folder, policy.max_length, stride=policy.overflow_stride,
            lowercase=plan.lowercase, pairs=False, keeps_last=self.truncates,
        )  # fmt: skip
        self._queries = TextTokenizer.from_folder(
            folder, plan.query_length - (markers[QUERY] is not None), lowercase=plan.lowercase, pairs=False
        )
        self._mask_id = _expansion_id(folder, vocabulary)
        unknown = _unknown_id(folder, vocabulary)
        skipped = {vocabulary.token_to_id(word) for word in plan.skiplist_words}
        skipped = {unknown if i is None else i for i in skipped} - {None}
        self._skiplist = torch.tensor(sorted(skipped), dtype=torch.int64, device=device)
        self.policy, self._markers = policy, markers
        self.type_ids = takes_type_ids(encoder)
        self.merge_rules = windowing.merges(
            _OUTPUTS, policy, {"embedding": "rows", "tokens": "sum", "windows": "sum"}
        )
        check_ragged_output(config, "embedding", "FP32", [-1, dense.out_features], "one row per token")
        self.set_device(device)
        self._model, self.dense, self.plan = encoder, dense, plan
        self.calibrate(parameters, self._encode)

    def close(self) -> None:
        """Drop the projections and :meth:`TextHandler.close`."""
        self.dense = self.plan = self._queries = None
        super().close()

    def _encode(self, features: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Token vectors ``[U, T, dim]`` (float32, unit norm) of tokenized strings."""
        assert self.dense is not None
        hidden = self.model(**features, return_dict=True)["last_hidden_state"]
        return F.normalize(self.dense(hidden).float(), p=2, dim=-1)

    # --- preparations ---------------------------------------------------------------------------

    def _marked(self, ids: Ids, kind: int) -> Ids:
        """``ids`` with the kind's marker inserted after the first token (PyLate's
        ``insert_prefix_token``)."""
        marker = self._markers.get(kind)
        if marker is None or not len(ids):
            return ids
        return np.concatenate((ids[:1], np.array([marker], dtype=np.int32), ids[1:]))

    def _query_ids(self, texts: Sequence[str]) -> list[Ids]:
        """Each text as a query: stripped (as PyLate's tokenizer call does), cut at
        ``query_length``, marked, not yet expanded."""
        assert self._queries is not None
        return [self._marked(ids, QUERY) for ids in self._queries.encode([t.strip() for t in texts])]

    def split_windows(
        self,
        texts: Sequence[str],
        queries: Sequence[str] | None,
        truncate: npt.NDArray[np.int64] | None = None,
    ) -> list[list[windowing.Span]]:
        """:meth:`TextHandler.split_windows` of the stripped texts, the spans in the texts as given."""
        leads = [len(t) - len(t.lstrip()) for t in texts]
        split = super().split_windows([t.strip() for t in texts], queries, truncate)
        return [
            [dataclasses.replace(s, start=s.start + lead, stop=s.stop + lead) for s in spans]
            for spans, lead in zip(split, leads, strict=True)
        ]

    def window_queries(self, queries: Sequence[str] | None) -> None:
        """None: a window holds its text alone (its query is encoded on its own)."""
        return None

    def query_parts(self, queries: Sequence[str] | None, count: int) -> list[Ids | None]:
        """Each text's query as a query's ids (empty: none), each distinct query tokenized once."""
        if queries is None:
            return [_NONE] * count
        distinct = sorted({q for q in queries if q})
        ids = dict(zip(distinct, self._query_ids(distinct), strict=True))
        return [ids[q] if q else _NONE for q in queries]

    def window_parts(self, window: Window, extra: Ids | None) -> Parts:
        """A window's ``(marked ids, its text's query ids, [UNRESOLVED, start])``."""
        return (
            self._marked(window.ids, DOCUMENT),
            extra if extra is not None else _NONE,
            _info(UNRESOLVED, window.start),
        )

    def item_parts(self, inputs: Mapping[str, npt.NDArray[Any]]) -> list[Parts]:
        """Each item's preparation (class docstring): from ``inputs[PREPARED]`` where its kind is
        known; a window's kind set by its ``input_type`` (a query's first window tokenized again
        as a query, its later windows empty); the others tokenized here.

        Raises:
            ValueError: ``text`` missing, invalid UTF-8, a wrong shape, an unknown ``input_type``,
                a query item with a ``query`` to score, ``truncate_prompt_tokens`` for a query or
                out of range.
        """
        given = prepared_parts(inputs)
        if given is not None and all(p is not None and int(p[2][0]) != UNRESOLVED for p in given):
            return given  # type: ignore[return-value]
        count = len(given) if given is not None else len(np.asarray(inputs.get("text", ())).reshape(-1))
        kinds = [QUERY if t == "query" else DOCUMENT for t in input_types(inputs, count)]
        keep = self.keep(inputs, count)
        out: list[Parts | None] = [None] * count
        for i, parts in enumerate(given or [None] * count):
            if parts is None:
                continue
            kind, start = int(parts[2][0]), int(parts[2][1])
            if kind != UNRESOLVED:
                out[i] = parts
            elif kinds[i] == DOCUMENT:
                out[i] = (parts[0], parts[1], _info(DOCUMENT, start))
            elif start > 0:  # a query's later window: PyLate's truncation drops it
                out[i] = (_NONE, parts[1], _info(QUERY, start))
        missing = [i for i, p in enumerate(out) if p is None]
        if missing:
            texts, queries = text_inputs(inputs)
            query_ids = self.query_parts([queries[i] for i in missing], len(missing))
            documents = [i for i in missing if kinds[i] == DOCUMENT]
            cut = self.kept_windows(
                [texts[i].strip() for i in documents], None, [keep[i] for i in documents] if keep else None
            )
            whole = [i for k, i in enumerate(documents) if k not in cut]
            ids: dict[int, Ids] = {documents[k]: self._marked(w.ids, DOCUMENT) for k, w in cut.items()}
            stripped = [texts[i].strip() for i in whole]
            ids.update(
                zip(whole, (self._marked(x, DOCUMENT) for x in self.tokenizer.encode(stripped)), strict=True)
            )
            asked = [i for i in missing if kinds[i] == QUERY]
            ids.update(zip(asked, self._query_ids([texts[i] for i in asked]), strict=True))
            for k, i in enumerate(missing):
                query = query_ids[k]
                out[i] = (ids[i], query if query is not None else _NONE, _info(kinds[i], 0))
        for i, parts in enumerate(out):
            assert parts is not None
            if int(parts[2][0]) == QUERY and len(parts[1]):
                raise ValueError(f"item {i} is a query (input_type) with a query to score against it")
            if int(parts[2][0]) == QUERY and keep is not None and keep[i]:
                raise ValueError(
                    f"item {i}: truncate_prompt_tokens applies to documents; a query is cut at query_length"
                )
        return out  # type: ignore[return-value]

    def _run(self, ids: Ids, kind: int) -> tuple[Ids, int]:
        """A string as the model runs it: a query expanded with mask tokens to ``query_length``
        (where the folder expands queries), and the tokens attended to."""
        plan = self._plan
        if kind != QUERY or not plan.do_query_expansion or len(ids) >= plan.query_length:
            return ids, len(ids)
        run = np.concatenate((ids, np.full(plan.query_length - len(ids), self._mask_id, dtype=np.int32)))
        return run, plan.query_length if plan.attend_to_expansion_tokens else len(ids)

    def item_costs(self, inputs: Mapping[str, npt.NDArray[Any]]) -> Priced:
        """The tokens each item makes the model run, int64 ``[B]``: its text's and its query's,
        as run (markers and expansion included); a string already priced for an earlier item of
        the request costs 0 there (each distinct string is encoded once per batch). With each
        item's preparation (class docstring).

        Raises:
            ValueError: as :meth:`item_parts`.
        """
        parts = self.item_parts(inputs)
        costs = np.zeros(len(parts), dtype=np.int64)
        priced: set[bytes] = set()
        for item, (text, query, info) in enumerate(parts):
            for ids, kind in ((text, int(info[0])), (query, QUERY)):
                key = bytes([kind]) + ids.tobytes()
                if len(ids) and key not in priced:
                    priced.add(key)
                    costs[item] += len(self._run(ids, kind)[0])
        return Priced(costs, prepared_array(parts))

    # --- per batch ----------------------------------------------------------------------------

    def preprocess(self, inputs: Mapping[str, npt.NDArray[Any]]) -> MultiVectorBatch:
        """Each distinct string of the batch (texts and queries) once, as run, padded in length
        groups on the device (module docstring; :meth:`TextHandler.batch_cost`'s cost model).

        Raises:
            ValueError: as :meth:`item_parts`.
        """
        parts = self.item_parts(inputs)
        rows: dict[bytes, int] = {}
        strings: list[tuple[Ids, int, int]] = []  # (ids as run, attended, kind)

        def row(ids: Ids, kind: int) -> int:
            if not len(ids):
                return -1
            key = bytes([kind]) + ids.tobytes()
            found = rows.get(key)
            if found is None:
                found = rows[key] = len(strings)
                strings.append((*self._run(ids, kind), kind))
            return found

        text_rows = np.array([row(text, int(info[0])) for text, _, info in parts], dtype=np.int64)
        query_rows = np.array([row(query, QUERY) for _, query, _ in parts], dtype=np.int64)
        tokens = np.array([len(strings[r][0]) if r >= 0 else 0 for r in text_rows], dtype=np.int64)
        lengths = np.fromiter((len(s[0]) for s in strings), dtype=np.int64, count=len(strings))
        groups = self.cost.groups(lengths) if len(strings) else []
        order = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
        position = np.empty(len(strings), dtype=np.int64)
        position[order] = np.arange(len(strings))
        scored = np.flatnonzero((query_rows >= 0) & (text_rows >= 0))
        indices = {
            "attended": np.array([strings[r][1] for r in order], dtype=np.int64),
            "length": lengths[order],
            "document": np.array([strings[r][2] == DOCUMENT for r in order], dtype=np.int64),
            "scored_text": position[text_rows[scored]],
            "scored_query": position[query_rows[scored]],
        }
        *features, placed = self.features([[strings[r][0] for r in g] for g in groups], indices=indices)
        text = np.where(text_rows >= 0, position[np.maximum(text_rows, 0)], -1)
        return MultiVectorBatch(features, placed, text, scored, tokens)

    def predict(self, batch: MultiVectorBatch) -> MultiVectorOutputs:
        """Encode the distinct strings (one call per length group, each string attending to its
        ``attended`` tokens), keep each one's rows (a document's without its punctuation and
        padding; a query's expansion included), and score each item's query against its text."""
        index = batch.indices
        width = max((int(g["input_ids"].shape[1]) for g in batch.groups), default=1)
        rows, keeps, offset = [], [], 0
        for group in batch.groups:
            ids = group["input_ids"]
            count, length = ids.shape
            span = slice(offset, offset + count)
            offset += count
            positions = torch.arange(length, device=ids.device)
            mask = positions < index["attended"][span, None]
            vectors = self._encode({**group, "attention_mask": mask.long()})
            document = index["document"][span, None].bool()
            useful = ~torch.isin(ids, self._skiplist) & mask
            keep = torch.where(document, useful, positions < index["length"][span, None])
            rows.append(F.pad(vectors, (0, 0, 0, width - length)))
            keeps.append(F.pad(keep, (0, width - length)))
        dim = self.embedding_dim
        all_rows = torch.cat(rows) if rows else torch.zeros(0, width, dim, device=self._device)
        keep = torch.cat(keeps) if keeps else torch.zeros(0, width, dtype=torch.bool, device=self._device)
        score = torch.zeros(len(batch.text), device=all_rows.device)
        if len(batch.scored):
            text, query = index["scored_text"], index["scored_query"]
            found = maxsim(all_rows[query], keep[query], all_rows[text], keep[text])
            score[torch.as_tensor(batch.scored, device=score.device)] = found
        return MultiVectorOutputs(all_rows, keep, score, batch.text, batch.tokens)

    def postprocess(self, outputs: MultiVectorOutputs) -> dict[str, npt.NDArray[Any]]:
        """``{"embedding": ragged float32 [n_i, dim], "score": float32 [B, 1], "tokens": int64
        [B, 1], "windows": int64 [B, 1]}`` on the host (``windows``: 1 each)."""
        rows = outputs.rows.to("cpu", torch.float32).numpy()
        keep = outputs.keep.to("cpu").numpy()
        empty = np.zeros((0, rows.shape[-1]), dtype=np.float32)
        embedding = [rows[r][keep[r]] if r >= 0 else empty for r in outputs.text]
        return {
            "embedding": ragged(embedding),
            "score": outputs.score.to("cpu", torch.float32).numpy().reshape(-1, 1),
            "tokens": outputs.tokens.reshape(-1, 1),
            "windows": np.ones((len(outputs.tokens), 1), dtype=np.int64),
        }


def _unknown_id(folder: Path, tokenizer: Tokenizer) -> int | None:
    """The unknown token's id (transformers' ``convert_tokens_to_ids`` answers it for a token
    the vocabulary lacks)."""
    name = special_token(folder, "unk_token")
    return tokenizer.token_to_id(name) if name is not None else None


def _token_id(tokenizer: Tokenizer, token: str, folder: Path) -> int | None:
    """The id of a marker (None: "", no marker), as transformers' ``convert_tokens_to_ids``
    gives it: the unknown token's where the vocabulary lacks it.

    Raises:
        ValueError: a marker neither in the vocabulary nor mapped to an unknown token.
    """
    if not token:
        return None
    found = tokenizer.token_to_id(token)
    found = found if found is not None else _unknown_id(folder, tokenizer)
    if found is None:
        raise ValueError(f"{folder}: the marker {token!r} is not in the tokenizer's vocabulary")
    return found


def _expansion_id(folder: Path, tokenizer: Tokenizer) -> int:
    """The token a query is expanded with: the mask token, else the end-of-sequence one, else the
    pad token (PyLate's choice).

    Raises:
        ValueError: none of the three.
    """
    for name in ("mask_token", "eos_token", "pad_token"):
        token = special_token(folder, name)
        found = tokenizer.token_to_id(token) if token is not None else None
        if found is not None:
            return found
    raise ValueError(f"{folder}: no mask, end-of-sequence or pad token to expand queries with")
