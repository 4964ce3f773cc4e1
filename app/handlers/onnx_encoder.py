"""The ONNX Runtime backend of :class:`app.handlers.sentence_embedding.SentenceEmbeddingHandler`
(``backend = "onnx"`` under ``[parameters]``).

The folder's embedding pipeline stays what it is (tokenizer, *Transformer -> Pooling ->
Normalize*: :mod:`app.handlers.embedding_pipeline`), except that the transformer runs as an
ONNX graph in ONNX Runtime: :class:`OnnxTextEncoder` feeds the graph the tokenized strings and
hands its token embeddings to the pipeline's own pooling and normalisation
(``EmbeddingPipeline.finish``), as sentence-transformers' ``backend="onnx"`` does. The graph is the
transformer alone, ``input_ids`` / ``attention_mask`` / ``token_type_ids`` int64 ``[U, T]`` ->
``token_embeddings`` (or ``last_hidden_state``, optimum's name) float ``[U, T, hidden]``, as
``scripts/export_sentence_embedding.py`` (``torch.onnx.export``) or optimum's exporter write it.

Why not sentence-transformers' own ``backend="onnx"``: it loads the graph through optimum,
whose releases pin ``transformers<4.58`` (this server runs transformers 5); the graph format is
the same, so a file optimum exported serves here too.

On a CUDA device the session runs with I/O binding on the handler's torch tensors: the graph
reads ``input_ids`` (already on the device) and writes the token embeddings into a torch tensor
on the device, so nothing passes through the host; Pooling and Normalize then run on the
device as they do with the torch backend.

``[parameters]`` (besides the handler's own): ``onnx_file`` (default ``"model.onnx"``, relative
to the model's folder), ``min_cosine`` (refuse to load when the graph's embeddings of
``min_cosine_texts`` calibration texts, default 64, have a cosine to the torch pipeline's below
it: the check a reduced-precision file such as ``model.int8.onnx`` needs), ``tensorrt``.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from app.handlers.embedding_pipeline import EmbeddingPipeline
from app.onnx_session import GraphTensor, graph_inputs, graph_outputs, open_session

log = logging.getLogger(__name__)

#: The ``[parameters]`` the ONNX backend reads, beyond the handler's own.
PARAMETERS = ("backend", "onnx_file", "min_cosine", "min_cosine_texts", "tensorrt")
#: Names of the graph's output, in order of preference (ours, then optimum's).
TOKEN_OUTPUTS = ("token_embeddings", "last_hidden_state")
_FLOATS = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16}

#: Turns features (the tokenizer's tensors, on the device) into sentence embeddings ``[U, dim]``.
Encode = Callable[[dict[str, torch.Tensor]], torch.Tensor]


def check_parameters(parameters: Mapping[str, Any]) -> None:
    """The ONNX backend's ``[parameters]``.

    Raises:
        ValueError: naming the parameter and what it must be.
    """
    backend = parameters.get("backend", "torch")
    if backend not in ("torch", "onnx"):
        raise ValueError(f"parameters.backend must be 'torch' or 'onnx', got {backend!r}")
    if backend == "torch":
        used = sorted(set(parameters) & (set(PARAMETERS) - {"backend"}))
        if used:
            raise ValueError(f"parameters {used} apply to backend = 'onnx' only")
        return
    if parameters.get("dtype", "float32") != "float32" or "attn_implementation" in parameters:
        raise ValueError(
            "parameters.dtype and attn_implementation apply to backend = 'torch'; an ONNX graph's "
            "precision and kernels are its file's (onnx_file = 'model.int8.onnx', say)"
        )
    onnx_file = parameters.get("onnx_file", "model.onnx")
    if not isinstance(onnx_file, str) or not onnx_file:
        raise ValueError(f"parameters.onnx_file must be a non-empty string, got {onnx_file!r}")
    bound = parameters.get("min_cosine")
    if bound is not None and (
        isinstance(bound, bool) or not isinstance(bound, int | float) or not -1 <= bound <= 1
    ):
        raise ValueError(f"parameters.min_cosine must be a number in [-1, 1], got {bound!r}")
    texts = parameters.get("min_cosine_texts", 64)
    if isinstance(texts, bool) or not isinstance(texts, int) or texts < 1:
        raise ValueError(f"parameters.min_cosine_texts must be a positive integer, got {texts!r}")
    if not isinstance(parameters.get("tensorrt", False), bool):
        raise ValueError("parameters.tensorrt must be true or false")


def onnx_path(parameters: Mapping[str, Any], model_path: Path) -> tuple[Path, str]:
    """The graph file of ``parameters.onnx_file`` (relative to ``model_path``, the model's folder
    in the repository, unless absolute) and how messages name it (``<folder>/<file>``)."""
    name = str(parameters.get("onnx_file", "model.onnx"))
    path = Path(name).expanduser()
    if path.is_absolute():
        return path, path.name
    return model_path / path, f"{model_path.name}/{name}"


class OnnxTextEncoder:
    """The transformer of an embedding pipeline as an ONNX Runtime session, and the pipeline's
    pooling and normalisation (see the module docstring).

    Args:
        pipeline: the loaded :class:`~app.handlers.embedding_pipeline.EmbeddingPipeline`.
        names: the inputs the handler's tokenizing gives (``input_ids``, ``attention_mask``,
            ``token_type_ids``...).
        path, shown: the graph file, and how messages name it.
        device: where the session runs (``cpu`` or ``cuda:N``).
        threads: intra-op threads.
        tensorrt: put TensorRT before CUDA on a CUDA device.

    Raises:
        ModelLoadError: the file is missing or not loadable (:func:`app.onnx_session.open_session`).
        ValueError: the graph needs an input the tokenizer does not give, or a non-int64 one, or
            has no float ``token_embeddings`` / ``last_hidden_state`` output of rank 3 and the
            model's hidden size.
    """

    def __init__(
        self,
        pipeline: EmbeddingPipeline,
        names: Sequence[str],
        path: Path,
        shown: str,
        device: torch.device,
        threads: int,
        *,
        tensorrt: bool = False,
    ) -> None:
        self.session = open_session(path, shown, device, threads, tensorrt=tensorrt)
        self.device = device
        self.hidden = pipeline.hidden_size
        self._inputs = self._check_inputs(graph_inputs(self.session), names, shown)
        self._output = self._check_output(graph_outputs(self.session), shown)
        self._dtype = _FLOATS[self._output.type]
        self._finish = pipeline.finish

    @property
    def input_names(self) -> list[str]:
        """The graph's inputs, in graph order."""
        return list(self._inputs)

    @staticmethod
    def _check_inputs(inputs: Sequence[GraphTensor], names: Sequence[str], shown: str) -> list[str]:
        given = set(names)
        missing = [g.name for g in inputs if g.name not in given]
        if missing:
            raise ValueError(
                f"{shown} needs inputs {missing} that the tokenizer does not give ({sorted(given)})"
            )
        for g in inputs:
            if g.type != "tensor(int64)" or len(g.shape) != 2:
                raise ValueError(
                    f"{shown}: input {g.name!r} is {g.type} {g.shown()}, expected int64 [batch, tokens]"
                )
        return [g.name for g in inputs]

    def _check_output(self, outputs: Sequence[GraphTensor], shown: str) -> GraphTensor:
        by_name = {g.name: g for g in outputs}
        found = next((by_name[n] for n in TOKEN_OUTPUTS if n in by_name), None)
        if found is None:
            raise ValueError(
                f"{shown} has no output named {' or '.join(TOKEN_OUTPUTS)} (its outputs: {sorted(by_name)}): "
                "export the transformer alone (scripts/export_sentence_embedding.py)"
            )
        width = found.fixed(2) if len(found.shape) == 3 else None
        if found.type not in _FLOATS or len(found.shape) != 3 or width not in (None, self.hidden):
            raise ValueError(
                f"{shown}: output {found.name!r} is {found.type} {found.shown()}, expected float "
                f"[batch, tokens, {self.hidden}] (the model's hidden size)"
            )
        return found

    def __call__(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sentence embeddings ``[U, dim]`` (the pipeline's dtype: float32) of the tokenised
        strings ``features`` (int64 ``[U, T]`` each, on the device)."""
        features = dict(features)
        features["token_embeddings"] = self._token_embeddings(features).float()
        return self._finish(features)

    def _token_embeddings(self, features: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The graph's output float ``[U, T, hidden]``: numpy in and out on the CPU; on CUDA the
        graph reads the torch tensors and writes into one, on the device (I/O binding)."""
        if self.device.type != "cuda":
            feeds = {name: features[name].numpy() for name in self._inputs}
            return torch.from_numpy(self.session.run([self._output.name], feeds)[0])
        index = self.device.index or 0
        binding = self.session.io_binding()
        tensors = [features[name].contiguous() for name in self._inputs]
        for name, tensor in zip(self._inputs, tensors, strict=True):
            binding.bind_input(name, "cuda", index, np.int64, tuple(tensor.shape), tensor.data_ptr())
        rows, tokens = tensors[0].shape
        out = torch.empty((rows, tokens, self.hidden), dtype=self._dtype, device=self.device)
        numpy_dtype = np.float32 if self._dtype == torch.float32 else np.float16
        binding.bind_output(self._output.name, "cuda", index, numpy_dtype, tuple(out.shape), out.data_ptr())
        # ONNX Runtime runs on a CUDA stream of its own: the inputs (copied on the runner's copy
        # stream, which the current stream waits for) must be there before it reads them; its
        # run returns once its stream is done, so what runs after on this stream reads `out`.
        torch.cuda.current_stream(self.device).synchronize()
        self.session.run_with_iobinding(binding)
        return out


def calibration_texts(tokenizer: Any, count: int, seed: int = 0) -> list[str]:
    """``count`` texts of a feed's mixed lengths, the same for the same tokenizer and seed: every
    other one a title (5-15 words), the others descriptions (40-200 words), words drawn with
    Zipf weights by rank from the tokenizer's whole-word vocabulary (as
    ``benchmarks.payloads.feed_texts`` draws them)."""
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    words = [w for w, _ in vocabulary if w.isascii() and w.isalpha() and len(w) > 1] or ["text"]
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    rng = random.Random(seed)
    return [
        " ".join(
            rng.choices(words, weights=weights, k=rng.randint(5, 15) if i % 2 == 0 else rng.randint(40, 200))
        )
        for i in range(count)
    ]


def cosines(encode: Encode, reference: Encode, features: Sequence[dict[str, torch.Tensor]]) -> np.ndarray:
    """The cosine of ``encode``'s and ``reference``'s embedding of each string of ``features``
    (batches of tokenised strings), float64 ``[U]``, in order."""
    out = []
    with torch.inference_mode():
        for batch in features:
            a, b = encode(dict(batch)).float().cpu(), reference(dict(batch)).float().cpu()
            out.append(F.cosine_similarity(a, b, dim=1).double().numpy())
    return np.concatenate(out)


def check_min_cosine(
    encode: Encode, reference: Encode, features: Sequence[dict[str, torch.Tensor]], bound: float, shown: str
) -> tuple[float, float]:
    """The minimum and mean cosine of ``encode`` to ``reference`` over ``features``
    (:func:`cosines`), logged.

    Raises:
        ValueError: the minimum is below ``bound`` (NaN counts as below).
    """
    values = cosines(encode, reference, features)
    low, mean = float(values.min()), float(values.mean())
    log.info(
        "%s: min cosine %.6f, mean %.6f to the torch pipeline over %d texts", shown, low, mean, len(values)
    )
    if not low >= bound or math.isnan(low):
        raise ValueError(
            f"{shown}: its embeddings of {len(values)} calibration texts have a min cosine of {low:.6f} "
            f"(mean {mean:.6f}) to the torch pipeline's, below min_cosine = {bound}"
        )
    return low, mean


def verify(
    encoder: OnnxTextEncoder,
    reference: Encode,
    tokenizer: Any,
    tokenize: Callable[[list[str]], dict[str, torch.Tensor]],
    bound: float,
    count: int,
    shown: str,
) -> tuple[float, float]:
    """:func:`check_min_cosine` of ``encoder`` (on its device) to ``reference`` (the torch
    pipeline, on the CPU) over ``count`` :func:`calibration_texts` of ``tokenizer``, in batches
    of 16, each made by ``tokenize`` (strings -> the model's inputs on the CPU).

    Raises:
        ValueError: the minimum cosine is below ``bound``.
    """
    texts = calibration_texts(tokenizer, count)
    batches = [tokenize(texts[i : i + 16]) for i in range(0, len(texts), 16)]

    def on_device(features: dict[str, torch.Tensor]) -> torch.Tensor:
        return encoder({k: v.to(encoder.device) for k, v in features.items()})

    return check_min_cosine(on_device, reference, batches, bound, shown)


def open_encoder(
    pipeline: EmbeddingPipeline,
    names: Sequence[str],
    tokenizer: Any,
    tokenize: Callable[[list[str]], dict[str, torch.Tensor]],
    device: torch.device,
    config: Any,
) -> OnnxTextEncoder:
    """The graph ``config``'s ``[parameters]`` name (:func:`onnx_path`) opened on ``device`` with
    ``torch.get_num_threads()`` intra-op threads, checked against ``pipeline`` (on the CPU) where
    ``min_cosine`` asks (:func:`verify`, texts of ``tokenizer`` made into inputs by ``tokenize``);
    the pipeline's transformer weights are then dropped (moved to the meta device).

    Raises:
        ModelLoadError: a missing or unloadable file.
        ValueError: a graph that does not fit the pipeline, or strays further than ``min_cosine``.
    """
    parameters = config.parameters
    file, shown = onnx_path(parameters, config.path)
    tensorrt = bool(parameters.get("tensorrt", False))
    encoder = OnnxTextEncoder(
        pipeline, names, file, shown, device, torch.get_num_threads(), tensorrt=tensorrt
    )
    if parameters.get("min_cosine") is not None:
        texts = int(parameters.get("min_cosine_texts", 64))
        verify(encoder, pipeline, tokenizer, tokenize, float(parameters["min_cosine"]), texts, shown)
    pipeline.drop_transformer()  # the graph replaces it: free its weights
    return encoder
