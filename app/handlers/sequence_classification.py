"""Sequence classifiers and cross-encoders from a Hugging Face folder, with long texts in windows.

``SequenceClassificationHandler`` serves any folder that transformers'
``AutoModelForSequenceClassification`` loads (``config.json`` with ``id2label``, weights, a
``tokenizer.json``), from local files only: a classifier (single texts -> per-label
probabilities, e.g. a toxicity model) or a cross-encoder (``(query, text)`` pairs -> a relevance
score, e.g. cross-encoder/ms-marco-MiniLM-L-6-v2). A text longer than ``max_seq_length`` becomes
several windows, each an item of its own, put back together per text (:mod:`app.models.windows`,
:mod:`app.serving.windows`).

Inputs (per item):

``text``  BYTES, required
    UTF-8 text to classify or score.
``query`` BYTES, optional
    UTF-8 query: the item is then the pair (query, text), as a cross-encoder takes it. Omitted
    or empty: the text alone.
``prefix`` BYTES, optional, a decoder's only (declare it ``shared = "once"``)
    UTF-8 text the model reads before the item's text: an instruction, or a user's context that
    a request's N candidates share ("User: ... likes: ...\nPost:"). The item is the token
    sequence of the tokenizer's leading special tokens (a BOS), the prefix's tokens (no special
    tokens of their own), then the text's (its template's trailing special tokens included): as
    if the text began with the prefix, tokenized apart. The prefix's keys and values are computed
    once per distinct prefix of a batch and kept in the prefix cache for the next request with
    the same prefix, each item run against them (:mod:`app.handlers.prefix_sharing`); every
    result equals the sequence scored whole within float rounding. Each window of a long text is
    an item after the same prefix. Omitted or empty: the text alone. A prefix of more than
    ``max_prefix_tokens`` tokens is refused (400 naming both).

Outputs (declare those you serve):

``probabilities`` FP32 ``[num_labels]``, with ``labels`` in ``model.toml``
    Per label, in ``id2label`` order: softmax over the logits (sigmoid per label for a
    one-label model or a ``multi_label_classification`` one, as sentence-transformers'
    ``CrossEncoder`` and transformers' text-classification pipeline apply them). The output's
    ``labels`` must list the folder's ``id2label`` names in order (the load says so otherwise):
    the classify API and Triton's classification extension name labels from it.
``score`` FP32 ``[1]``
    The probability of label ``score_label`` (default: the last label; a cross-encoder has one):
    a relevance score for pairs, e.g. "toxic" for a moderation model.
``windows`` INT64 ``[1]``
    Windows the text took (1 unless it was longer than ``max_seq_length``).
``tokens`` INT64 ``[1]``
    Tokens the item made the model run, over all its windows, special tokens included (with a
    ``prefix``, each window's sequence: the prefix counted with it, however often it ran).

Windows' results per text (put together by :mod:`app.serving.windows`): probabilities and
scores by ``aggregate`` (``"max"`` by default: MaxP for pairs, "flagged if any part is" for
moderation; ``"mean"`` selectable).

With a ``prefix`` input: ``max_prefix_tokens`` (int, default the model's positions less
``max_seq_length``: a window and a prefix must fit the model's positions together; where
``max_seq_length`` is not given it defaults to half of what it would be without the prefix),
``shared_prefix`` and ``prefix_cache_bytes`` (:mod:`app.handlers.prefix_sharing`).

``[parameters]`` of ``model.toml``: those of :mod:`app.handlers.text_config` (``max_seq_length``:
tokens per window, default the tokenizer's ``model_max_length`` capped by the model's
positions), ``backend`` (``"torch"`` or ``"onnx"``: ``onnx_file``, default ``model.onnx`` in the
model's folder, a graph of the classifier whose inputs are the tokenizer's and whose first output
is the logits) and ``tensorrt``; ``score_label`` (name or index); and the window parameters of
:mod:`app.models.windows` (``truncation = "window"`` by default).

An item's preparation is its token ids, and with them its token type ids where the model takes
them (empty for a single text: every position then has the single-string type id).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from app.handlers import prefix_sharing
from app.handlers.decoder_math import last_token_pool
from app.handlers.decoders import decoder_features, is_decoder, pad_decoder
from app.handlers.text_base import TextHandler, max_length
from app.handlers.text_config import (
    SHARED_PARAMETERS,
    ModelConfigLike,
    check_shared_parameters,
    declares_truncation,
    decode_texts,
    resolve_model_dir,
)
from app.handlers.tokenizing import Ids, Parts, TextTokenizer, Window, prepared_array
from app.models import windows as windowing
from app.models.base import Priced, shared_rows

__all__ = ["PIECES", "ClassifiedBatch", "SequenceClassificationHandler", "labels_of", "piece_rows"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_PARAMETERS = (
    *SHARED_PARAMETERS, "score_label", "backend", "onnx_file", "tensorrt", *windowing.PARAMETERS,
    "max_prefix_tokens", *prefix_sharing.PARAMETERS,
)  # fmt: skip
#: The input of a text the model reads before each item's (module docstring).
PREFIX = "prefix"
_SINGLE: Ids = np.zeros(0, dtype=np.int32)
#: The output of per-piece (per-window) results.
PIECES = "pieces"
#: What ``postprocess`` returns.
_OUTPUTS = ("probabilities", "score", "windows", "tokens", PIECES)


def labels_of(hf_config: Any) -> list[str]:
    """The label names of a transformers config, in index order (``id2label``)."""
    id2label = {int(k): str(v) for k, v in dict(hf_config.id2label).items()}
    return [id2label.get(i, f"LABEL_{i}") for i in range(int(hf_config.num_labels))]


@dataclass(frozen=True)
class ClassifiedBatch:
    """``preprocess`` output.

    Attributes:
        groups: one forward call each, the model's padded inputs on the device, int64
            ``[B_g, T_g]``; the groups' items in ascending length.
        position: int64 ``[B]`` on the device: item b's row in the groups' rows, concatenated.
        tokens: int64 ``[B]`` on the host: tokens per item.
        spans: int32 ``[B, 2]`` on the host, each item's ``[start, stop)`` in its text (None:
            the model returns no ``pieces``).
        shared: the items run after a shared prefix (None: none); ``position`` then places the
            groups' results, then the shared calls'.
    """

    groups: list[dict[str, torch.Tensor]]
    position: torch.Tensor
    tokens: npt.NDArray[np.int64]
    spans: npt.NDArray[np.int32] | None = None
    shared: prefix_sharing.SharedRun | None = None


class SequenceClassificationHandler(TextHandler):
    """Classifies ``text`` or scores (``query``, ``text``) pairs (see the module docstring)."""

    kind = "SequenceClassificationHandler"
    #: Where the model keeps a prefix cache, for the memory plan (``app.models.memory``): a model
    #: that declares a ``prefix`` input.
    MEMORY_PREFIX_CACHE = "prefix"

    def __init__(self) -> None:
        super().__init__()
        self.labels: list[str] = []
        self.policy = windowing.WindowPolicy("window", 512, 64)
        self.score_index = 0
        self.sigmoid = False
        #: The ONNX Runtime session (``backend = "onnx"``); None: the torch model runs.
        self.session: Any = None
        self._onnx_inputs: list[str] = []
        #: Whether the model is a decoder (:func:`app.handlers.decoders.is_decoder`), and its
        #: score head (a linear layer on the last hidden state; None: the class has none).
        self.decoder = False
        self.head: Any = None
        #: With a ``prefix`` input: the tokens a prefix may have, the leading special tokens of
        #: the tokenizer's template (they come before the prefix).
        self.max_prefix = 0
        self.lead = 0

    def load(self, device: torch.device, config: ModelConfigLike) -> None:
        """Load the folder named in ``config.parameters`` onto ``device``, from local files only,
        then measure the cost model (:meth:`TextHandler.calibrate`) unless ``model.toml`` fixes it.

        Raises:
            ValueError: unknown or bad parameters; a ``max_seq_length`` over the model's
                positions; declared ``labels`` other than the folder's ``id2label`` (or none);
                a ``probabilities`` width other than the model's labels; an unknown
                ``score_label``; a folder without a tokenizer transformers can make fast.
            FileNotFoundError: a missing folder.
        """
        from transformers import AutoModelForSequenceClassification  # the modeling code, at load only
        from transformers.utils import logging as transformers_logging

        parameters = dict(config.parameters)
        check_shared_parameters(config.name, self.kind, parameters, _PARAMETERS)
        backend = parameters.get("backend", "torch")
        if backend not in ("torch", "onnx"):
            raise ValueError(f'parameters.backend must be "torch" or "onnx", got {backend!r}')
        path = resolve_model_dir(parameters, config.path)
        transformers_logging.disable_progress_bar()
        kwargs: dict[str, Any] = {"dtype": _DTYPES[parameters.get("dtype", "float32")]}
        if "attn_implementation" in parameters:
            kwargs["attn_implementation"] = parameters["attn_implementation"]
        model = AutoModelForSequenceClassification.from_pretrained(str(path), local_files_only=True, **kwargs)
        model.to(device).eval()
        limit = getattr(model.config, "max_position_embeddings", None)
        limit = limit if isinstance(limit, int) and limit > 0 else None
        default = min(TextTokenizer.model_max_length(path) or 512, limit or 512, 8192)
        prefixed = any(spec.name == PREFIX for spec in config.inputs)
        length = max_length(parameters, default // 2 if prefixed else default, limit, minimum=8)
        self.policy = windowing.WindowPolicy.from_parameters(parameters, length)
        self.truncates = declares_truncation(config)
        self.spans = any(spec.name == PIECES for spec in config.outputs)
        stride = self.policy.overflow_stride
        self.decoder = is_decoder(model.config)
        self._tokenizer = TextTokenizer.from_folder(path, length, stride=stride, keeps_last=self.truncates)
        if self.decoder:
            pad_decoder(self.tokenizer, path, model.config, config.name)
            self.head = _score_head(model)
            if backend != "torch":
                raise ValueError(
                    f'model {config.name!r}: backend = "{backend}" serves encoders; a decoder runs in torch'
                )
        self.labels = labels_of(model.config)
        self._check_outputs(config)
        self.score_index = self._score_index(parameters.get("score_label"))
        self.sigmoid = len(self.labels) == 1 or model.config.problem_type == "multi_label_classification"
        self.merge_rules = windowing.merges(
            _OUTPUTS, self.policy, {"tokens": "sum", "windows": "sum", PIECES: "concat"}
        )
        self.type_ids = not self.decoder and "token_type_ids" in inspect.signature(model.forward).parameters
        if prefixed:
            self._open_prefix(config, parameters, model, (limit or default) - length)
        self.set_device(device)
        self._model = model
        if backend == "onnx":
            self._open_onnx(device, config, str(parameters.get("onnx_file", "model.onnx")))
        self.calibrate(parameters, self._logits)

    def _open_prefix(
        self, config: ModelConfigLike, parameters: Mapping[str, Any], model: Any, room: int
    ) -> None:
        """Set up the ``prefix`` input (module docstring): its bound, the template's leading
        special tokens, shared-prefix scoring where the model can share.

        Raises:
            ValueError: an encoder's model; ``max_prefix_tokens`` not an integer >= 1, or more
                than the model's positions leave beside ``max_seq_length``.
        """
        if not self.decoder:
            raise ValueError(
                f"model {config.name!r}: input {PREFIX!r} is a decoder's (its keys and values are "
                "computed once); an encoder reads a text's tokens both ways: put it in the text"
            )
        if room < 1:
            raise ValueError(
                f"model {config.name!r}: max_seq_length {self.tokenizer.max_length} leaves no room for a "
                f"{PREFIX!r} in the model's {self.tokenizer.max_length + room} positions; lower it"
            )
        bound = parameters.get("max_prefix_tokens", room)
        if not isinstance(bound, int) or isinstance(bound, bool) or not 1 <= bound <= room:
            raise ValueError(
                f"parameters.max_prefix_tokens must be an integer from 1 to {room} (the model's positions "
                f"less max_seq_length {self.tokenizer.max_length}), got {bound!r}"
            )
        self.max_prefix = bound
        whole, alone = (self.tokenizer.encode(["a"], special=special)[0] for special in (True, False))
        self.lead = next(
            (i for i in range(len(whole) - len(alone) + 1) if (whole[i : i + len(alone)] == alone).all()), 0
        )
        identity = (config.name, str(getattr(config, "version", "")))
        sharing = prefix_sharing.PrefixSharing.from_parameters(model, parameters, identity, config.name)
        self.sharing = sharing if self.head is not None else None  # it reads the score head

    def _open_onnx(self, device: torch.device, config: ModelConfigLike, file: str) -> None:
        """Open the graph (inputs among the tokenizer's, first output the logits ``[batch,
        labels]``) on ``device`` and drop the torch model's weights: only the graph runs."""
        from app import onnx_session  # onnxruntime only for the models that ask for it

        shown = f"{config.path.name}/{file}"
        session = onnx_session.open_session(
            config.path / file,
            shown,
            device,
            torch.get_num_threads(),
            tensorrt=bool(config.parameters.get("tensorrt")),
        )
        names = [t.name for t in onnx_session.graph_inputs(session)]
        unknown = sorted(set(names) - {"input_ids", "attention_mask", "token_type_ids"})
        if unknown:
            raise ValueError(f"{shown}: graph inputs {unknown} are not the tokenizer's")
        self.type_ids = "token_type_ids" in names
        self.session, self._onnx_inputs = session, names
        self.model.to("meta")

    def use_model(self, model: Any, parameters: Mapping[str, Any]) -> None:
        """Serve ``model`` instead of the folder's weights: a transformers
        ``*ForSequenceClassification`` of the loaded folder's vocabulary and labels, already on the
        device (``benchmarks.decoder_check``: a 7B classifier with random weights made on the GPU,
        no download, no float32 copy), then measure the cost model on it unless ``parameters``
        fix it (:meth:`TextHandler.calibrate`)."""
        self._model, self.decoder = model.eval(), is_decoder(model.config)
        self.head = _score_head(model) if self.decoder else None
        if self.decoder and model.config.pad_token_id is None:
            model.config.pad_token_id = self.tokenizer.pad_id
        self.calibrate(parameters, self._logits)

    def close(self) -> None:
        """Drop the ONNX session too, then :meth:`TextHandler.close`."""
        self.session = self.head = None
        super().close()

    def _logits(self, group: dict[str, torch.Tensor]) -> torch.Tensor:
        """The logits ``[U_g, labels]`` of one padded group, by the torch model or the graph; a
        decoder's at each row's last real token (:mod:`app.handlers.decoders`): its base model's
        hidden state there through the score head (the head on ``U_g`` rows, not ``U_g x T_g``),
        or, for a class without a ``score`` head, transformers' own pooling by the pad id."""
        if self.decoder:
            features = decoder_features(group)
            if self.head is None:
                pooled: torch.Tensor = self.model(**features).logits
                return pooled.float()
            hidden = self.model.base_model(**features).last_hidden_state
            head: torch.Tensor = self.head(last_token_pool(hidden, group["attention_mask"]))
            return head.float()
        if self.session is None:
            logits: torch.Tensor = self.model(**group).logits
            return logits.float()
        feed = {name: group[name].cpu().numpy() for name in self._onnx_inputs}
        return torch.from_numpy(self.session.run(None, feed)[0]).float().to(self._device)

    def _check_outputs(self, config: ModelConfigLike) -> None:
        for spec in config.outputs:
            if spec.name != "probabilities":
                continue
            if list(spec.shape) not in ([-1], [len(self.labels)]):
                raise ValueError(
                    f"model {config.name!r}: output 'probabilities' is declared with shape "
                    f"{list(spec.shape)} "
                    f"but the model has {len(self.labels)} labels; declare shape = [{len(self.labels)}]"
                )
            if list(getattr(spec, "labels", None) or []) != self.labels:
                raise ValueError(
                    f"model {config.name!r}: output 'probabilities' must declare the folder's labels "
                    f"in order: labels = {self.labels!r}"
                )

    def _score_index(self, label: Any) -> int:
        if label is None:
            return len(self.labels) - 1
        if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(self.labels):
            return label
        if isinstance(label, str) and label in self.labels:
            return self.labels.index(label)
        raise ValueError(f"parameters.score_label {label!r} is not one of the model's labels {self.labels}")

    # --- per request ----------------------------------------------------------------------

    def prepare_texts(
        self, texts: Sequence[str], queries: Sequence[str], keep: Sequence[int] | None
    ) -> list[Parts]:
        """Each item's ids (pairs where a query is given), truncated to ``max_seq_length`` (a
        window of a long text fits: :mod:`app.serving.windows` cut it so), or cut to its last
        ``keep`` tokens where asked (:meth:`TextHandler.kept_windows`)."""
        cut = self.kept_windows(texts, queries, keep)
        out: list[Parts] = [self.window_parts(cut[i], None) if i in cut else () for i in range(len(texts))]
        single = [i for i, q in enumerate(queries) if not q and i not in cut]
        paired = [i for i, q in enumerate(queries) if q and i not in cut]
        if single:
            for i, ids in zip(single, self.tokenizer.encode([texts[i] for i in single]), strict=True):
                out[i] = (ids, _SINGLE) if self.type_ids else (ids,)
        if paired:
            pairs = self.tokenizer.encode_pairs([queries[i] for i in paired], [texts[i] for i in paired])
            for i, (ids, types) in zip(paired, pairs, strict=True):
                out[i] = (ids, types) if self.type_ids else (ids,)
        return out

    def item_costs(self, inputs: Mapping[str, npt.NDArray[Any]]) -> Priced:
        """Tokens each item makes the model run, int64 ``[B]``, special tokens (and a pair's
        query) included, truncated to ``max_seq_length``, with each item's token ids as its
        preparation (from ``inputs[PREPARED]`` where the window stage made it).

        Raises:
            ValueError: invalid UTF-8, a wrong shape, a ``query`` of another length.
        """
        parts = self.item_parts(inputs)
        if self.max_prefix:
            ids, splits = self._prefixed(parts, inputs)
            if self.sharing is not None:
                return Priced(self.sharing.costs(ids, splits), prepared_array(parts))
        else:
            ids = [p[0] for p in parts]
        costs = np.fromiter((len(i) for i in ids), dtype=np.int64, count=len(ids))
        return Priced(costs, prepared_array(parts))

    def _prefixed(
        self, parts: Sequence[Parts], inputs: Mapping[str, npt.NDArray[Any]]
    ) -> tuple[list[Ids], npt.NDArray[np.int64]]:
        """Each item's ids after its ``prefix`` (module docstring), and its split (the tokens of
        the leading special tokens and the prefix; 0 without a prefix). ``inputs[PREFIX]``: one
        row per item, or its distinct rows with each item's under ``shared_rows(PREFIX)``.

        Raises:
            ValueError: invalid UTF-8; a prefix of more than ``max_prefix_tokens`` tokens.
        """
        array = inputs.get(PREFIX)
        texts = decode_texts(PREFIX, np.asarray(array)) if array is not None else [""]
        rows = inputs.get(shared_rows(PREFIX))
        each = rows.tolist() if rows is not None else [0] * len(parts) if array is None else range(len(parts))
        tokens = dict(zip(texts, self.tokenizer.encode(texts, special=False), strict=True))
        for text, prefix in tokens.items():
            count = len(prefix)
            if count >= self.tokenizer.max_length:  # cut by the tokenizer: counted whole
                count = self.tokenizer.whole_counts([text])[0] - len(self.tokenizer.encode([""])[0])
            if count > self.max_prefix:
                raise ValueError(
                    f"a prefix of {count} tokens is over the model's max_prefix_tokens of {self.max_prefix}"
                )
        ids, splits = [], np.zeros(len(parts), dtype=np.int64)
        for b, (part, row) in enumerate(zip(parts, each, strict=True)):
            prefix, own = tokens[texts[row]], part[0]
            if not len(prefix):
                ids.append(own)
                continue
            ids.append(np.concatenate((own[: self.lead], prefix, own[self.lead :])))
            splits[b] = min(self.lead + len(prefix), len(ids[-1]) - 1)  # an item keeps a token
        return ids, splits

    def window_parts(self, window: Window, extra: Ids | None) -> Parts:
        """A window's ids (and type ids), as :meth:`item_costs` makes an item's."""
        if not self.type_ids:
            return (window.ids,)
        return (window.ids, window.type_ids if window.type_ids is not None else _SINGLE)

    def preprocess(self, inputs: Mapping[str, npt.NDArray[Any]]) -> ClassifiedBatch:
        """Pad the items' token ids (``inputs[PREPARED]``; tokenized here only where absent) in
        length groups, on the device.

        Raises:
            ValueError: as :meth:`item_costs` (where the items are tokenized here).
        """
        parts = self.item_parts(inputs)
        spans = np.stack([p[-1] for p in parts]) if self.spans else None
        ids, splits = self._prefixed(parts, inputs) if self.max_prefix else ([p[0] for p in parts], None)
        lengths = np.fromiter((len(i) for i in ids), dtype=np.int64, count=len(ids))
        if self.sharing is not None and splits is not None and splits.any():
            layout = prefix_sharing.lay_out(
                self.sharing, ids, splits, self.cost.groups,
                lambda rows, indices: self.features(rows, indices=indices), self._device,
            )  # fmt: skip
            return ClassifiedBatch(layout.groups, layout.position, lengths, spans, layout.shared)
        types = [_types(p, self.tokenizer.single_type_id) for p in parts] if self.type_ids else None
        encoded, position = self.length_grouped(ids, types)
        return ClassifiedBatch(groups=encoded, position=position, tokens=lengths, spans=spans)

    def predict(self, batch: ClassifiedBatch) -> dict[str, Any]:
        """``probabilities`` float32 ``[B, L]`` and ``score`` ``[B, 1]`` (on the device),
        ``windows`` (1 each: a window is an item) and ``tokens`` int64 ``[B]``."""
        parts = [self._logits(group) for group in batch.groups]
        if batch.shared is not None and self.sharing is not None:
            _, calls = self.sharing.run(batch.shared)
            parts += [self.head(states.last()).float() for states in calls]
        logits = (parts[0] if len(parts) == 1 else torch.cat(parts))[batch.position]
        probabilities = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)
        return {
            "probabilities": probabilities,
            "score": probabilities[:, self.score_index : self.score_index + 1],
            "windows": np.ones((len(batch.tokens), 1), dtype=np.int64),
            "tokens": batch.tokens.reshape(-1, 1),
            "spans": batch.spans,
        }

    def postprocess(self, outputs: dict[str, Any]) -> dict[str, npt.NDArray[Any]]:
        """Host numpy arrays: FP32 ``probabilities`` ``[B, L]`` and ``score`` ``[B, 1]``, INT64
        ``windows`` and ``tokens`` ``[B, 1]``, and where the model returns them BYTES ``pieces``
        ``[B, 1]`` (:func:`piece_rows`)."""
        out = {
            "probabilities": outputs["probabilities"].to("cpu", torch.float32).numpy(),
            "score": outputs["score"].to("cpu", torch.float32).numpy(),
            "windows": np.asarray(outputs["windows"], dtype=np.int64),
            "tokens": np.asarray(outputs["tokens"], dtype=np.int64),
        }
        if outputs.get("spans") is not None:
            out[PIECES] = piece_rows(outputs["spans"], out["probabilities"])
        return out


def piece_rows(spans: npt.NDArray[np.int32], probabilities: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
    """Each item's ``pieces`` output, BYTES ``[B, 1]``: a JSON array of one object
    ``{"start", "stop", "probabilities"}`` (the item's characters ``[start, stop)`` of its text,
    its probabilities in label order, float32 in their shortest form), which the window stage
    joins per text in piece order (the ``"concat"`` merge)."""
    import orjson

    out = np.empty((len(spans), 1), dtype=object)
    for i, ((start, stop), row) in enumerate(zip(spans.tolist(), probabilities, strict=True)):
        out[i, 0] = orjson.dumps(
            [{"start": start, "stop": stop, "probabilities": row}], option=orjson.OPT_SERIALIZE_NUMPY
        )
    return out


def _score_head(model: Any) -> Any:
    """A decoder classifier's score head: its ``score`` linear layer (Llama, Mistral, Qwen,
    GPT-2 and the other ``*ForSequenceClassification`` classes of transformers'
    ``GenericForSequenceClassification``), None where the class has another."""
    head = getattr(model, "score", None)
    return head if isinstance(head, torch.nn.Linear) else None


def _types(parts: Parts, single: int) -> Ids:
    """An item's token type ids: its pair's, or the single-string id at every position."""
    ids, types = parts[0], parts[1]
    return types if len(types) == len(ids) else np.full(len(ids), single, dtype=np.int32)
