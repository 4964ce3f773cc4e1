"""CUDA graphs of the text handlers (``app.handlers.text_graphs``), on the CPU: the token
buckets, the bucket choice, the padding a bucket's static inputs get, and that the real
all-MiniLM-L6-v2 pipeline run on those padded inputs gives the embeddings it gives unpadded,
with CPU stand-ins for the captured graphs (a replay runs the pipeline on the static inputs into
the static output, as a graph would); and the options' validation.

What only a GPU can show (capture, replay, parity with eager on CUDA): tests/gpu/test_gpu.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import msgspec
import pytest
import torch

from app.handlers.sentence_embedding import SentenceEmbeddingHandler
from app.handlers.text_graphs import TextBucket, TextGraphs, default_sequence_lengths
from app.models.repository import read_config
from app.serving.runner import ModelRunner
from tests.support.gunicorn import ROOT

MINILM = ROOT / "model_repository" / "all-MiniLM-L6-v2"
CPU = torch.device("cpu")
ROWS, TOKENS = [1, 4, 8], [16, 32, 64]


@pytest.mark.parametrize(
    ("longest", "lengths"),
    [(256, [16, 32, 64, 128, 256]), (300, [16, 32, 64, 128, 256, 300]), (16, [16]), (10, [10])],
)
def test_token_buckets_double_from_16_up_to_the_window(longest: int, lengths: list[int]) -> None:
    assert default_sequence_lengths(longest) == lengths


@pytest.fixture(scope="module")
def handler() -> Iterator[SentenceEmbeddingHandler]:
    runner = ModelRunner(read_config(MINILM))
    runner.load(CPU)
    assert isinstance(runner.handler, SentenceEmbeddingHandler)
    yield runner.handler


class StandIns:
    """Buckets whose replay runs ``encode`` on the static inputs (what a captured graph does),
    recording each replay's shape and a copy of what it read."""

    def __init__(self, handler: SentenceEmbeddingHandler) -> None:
        self.encode = handler._encode_torch
        self.eager: list[tuple[int, int]] = []
        self.seen: list[tuple[tuple[int, int], dict[str, torch.Tensor]]] = []
        names = handler.feature_names
        buckets = [self.bucket(names, r, t) for r in ROWS for t in TOKENS]
        self.graphs = TextGraphs(buckets, self.counted)

    def counted(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        self.eager.append(tuple(features["attention_mask"].shape))  # type: ignore[arg-type]
        return self.encode(features)

    def bucket(self, names: list[str], rows: int, tokens: int) -> TextBucket:
        inputs = {n: torch.zeros((rows, tokens), dtype=torch.int64) for n in names}
        inputs["attention_mask"][:, 0] = 1
        output = self.encode(dict(inputs)).clone()

        def replay() -> None:
            self.seen.append(((rows, tokens), {n: t.clone() for n, t in inputs.items()}))
            output.copy_(self.encode(dict(inputs)))

        return TextBucket(rows, tokens, inputs, output, replay)


def features(handler: SentenceEmbeddingHandler, strings: list[str]) -> dict[str, torch.Tensor]:
    """The strings tokenized and padded as one call, as the handler feeds its pipeline."""
    (group,) = handler.features([handler.tokenizer.encode(strings)])
    assert sorted(group) == handler.feature_names
    return group


def texts(count: int, words: int) -> list[str]:
    return [" ".join(f"topic{i} word{j}" for j in range(words)) for i in range(count)]


@pytest.mark.parametrize(
    ("count", "words", "bucket"),
    [(1, 2, (1, 16)), (3, 2, (4, 16)), (4, 5, (4, 32)), (6, 12, (8, 64)), (8, 3, (8, 16))],
)
@torch.inference_mode()
def test_a_batch_runs_padded_in_the_smallest_bucket_and_embeds_as_unpadded(
    handler: SentenceEmbeddingHandler, count: int, words: int, bucket: tuple[int, int]
) -> None:
    stand_ins = StandIns(handler)
    batch = features(handler, texts(count, words))
    rows, tokens = batch["attention_mask"].shape
    got = stand_ins.graphs(batch)
    assert stand_ins.eager == [] and [shape for shape, _ in stand_ins.seen] == [bucket]
    read = stand_ins.seen[0][1]
    for name, tensor in batch.items():
        torch.testing.assert_close(read[name][:rows, :tokens], tensor)
        assert not read[name][:rows, tokens:].any(), f"{name}: token padding is not zeros"
    assert (read["attention_mask"][rows:, 0] == 1).all() and not read["attention_mask"][rows:, 1:].any()
    assert got.shape == (rows, 384)
    torch.testing.assert_close(got, handler._encode_torch(dict(batch)), atol=1e-5, rtol=0)


@torch.inference_mode()
def test_padding_a_larger_batch_left_is_cleared(handler: SentenceEmbeddingHandler) -> None:
    stand_ins = StandIns(handler)
    stand_ins.graphs(features(handler, texts(8, 14)))  # 58 tokens: bucket (8, 64)
    small = features(handler, texts(5, 3))
    got = stand_ins.graphs(small)
    read = stand_ins.seen[-1][1]
    assert not read["input_ids"][5:, :].any() and not read["input_ids"][:, small["input_ids"].shape[1] :].any()
    torch.testing.assert_close(got, handler._encode_torch(dict(small)), atol=1e-5, rtol=0)


@torch.inference_mode()
def test_a_batch_above_every_bucket_runs_eagerly(handler: SentenceEmbeddingHandler) -> None:
    stand_ins = StandIns(handler)
    many, long = features(handler, texts(9, 2)), features(handler, texts(2, 40))
    for batch in (many, long):
        torch.testing.assert_close(stand_ins.graphs(batch), handler._encode_torch(dict(batch)))
    assert stand_ins.seen == []
    assert stand_ins.eager == [tuple(many["attention_mask"].shape), tuple(long["attention_mask"].shape)]


@torch.inference_mode()
def test_the_output_is_a_copy_the_next_replay_leaves_alone(handler: SentenceEmbeddingHandler) -> None:
    stand_ins = StandIns(handler)
    first = stand_ins.graphs(features(handler, texts(3, 4)))
    kept = first.clone()
    stand_ins.graphs(features(handler, ["something else entirely"] * 3))
    torch.testing.assert_close(first, kept)


# --- the options -----------------------------------------------------------------------------


def test_on_the_cpu_the_graphs_are_ignored_with_one_info_line(caplog: pytest.LogCaptureFixture) -> None:
    config = msgspec.structs.replace(read_config(MINILM), cuda_graph_batch_sizes=[1, 8, 32])
    config.validate()
    with caplog.at_level(logging.INFO, logger="app.handlers.text_graphs"):
        runner = ModelRunner(config)
        runner.load(CPU)
    assert runner.handler.cuda_graph_shapes == []  # type: ignore[attr-defined]
    assert "cuda_graph_batch_sizes ignored on cpu" in caplog.text


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([64, 16], "ascending"),
        ([0, 16], "ascending positive"),
        ("16", "ascending"),
        ([16, 512], "go past max_seq_length 256"),
    ],
)
def test_bad_token_buckets_are_refused_at_load(lengths: object, message: str) -> None:
    config = read_config(MINILM)
    config = msgspec.structs.replace(
        config,
        cuda_graph_batch_sizes=[1, 8],
        parameters={**config.parameters, "cuda_graph_sequence_lengths": lengths},
    )
    with pytest.raises(Exception, match=message):
        ModelRunner(config).load(CPU)
