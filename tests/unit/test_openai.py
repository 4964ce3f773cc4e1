"""``POST /v1/embeddings`` (OpenAI's embeddings API) in process, through the stock ``openai``
client: a string and a list, float and base64, usage from the model's tokens, the same vectors as
V2, OpenAI's error shape for what is refused."""

from __future__ import annotations

import asyncio
import base64
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from app.http.state import CORE
from tests.support.fixtures import Client, MakeClient, eventually
from tests.support.toy_models import EmbedHandler, ScaleHandler, write_embed_model, write_scale_model

TEXTS = ["a short title", "a somewhat longer description of an item", "ünïcödé"]


def client_of(http: Client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="unused", max_retries=0)


async def v2_embeddings(http: Client, texts: list[str]) -> np.ndarray:
    body = {"inputs": [{"name": "text", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}]}
    answer = await (await http.post("/v2/models/embed/infer", json=body)).json()
    out = next(o for o in answer["outputs"] if o["name"] == "embedding")
    return np.array(out["data"], np.float32).reshape(out["shape"])


@pytest.mark.parametrize(
    "encoding_format", [openai.NOT_GIVEN, "float", "base64"], ids=["default", "float", "base64"]
)
async def test_the_stock_client_gets_the_v2_vectors(
    make_client: MakeClient, tmp_path: Path, encoding_format: Any
) -> None:
    """Not given, the client asks for base64 and decodes it itself; asked for, it hands over what
    it got."""
    write_embed_model(tmp_path)
    http: Client = await make_client(tmp_path)
    client = client_of(http)
    one = await client.embeddings.create(model="embed", input=TEXTS[0], encoding_format=encoding_format)
    many = await client.embeddings.create(model="embed", input=TEXTS, encoding_format=encoding_format)
    want = await v2_embeddings(http, TEXTS)
    assert [d.index for d in many.data] == [0, 1, 2] and one.model == "embed" and one.object == "list"
    for got, expected in (
        (one.data[0].embedding, want[0]),
        *((d.embedding, w) for d, w in zip(many.data, want, strict=True)),
    ):
        # asked for base64, the client hands the string over as sent: little-endian float32
        vector = (
            np.frombuffer(base64.b64decode(got), "<f4")
            if isinstance(got, str)
            else np.asarray(got, np.float32)
        )
        assert float(vector @ expected / np.linalg.norm(vector) / np.linalg.norm(expected)) >= 0.99999
    assert many.usage.prompt_tokens == many.usage.total_tokens == sum(len(t.split()) for t in TEXTS)
    await client.close()


async def test_bad_requests_get_openais_error_shape(make_client: MakeClient, tmp_path: Path) -> None:
    write_embed_model(tmp_path)
    write_scale_model(tmp_path)
    http: Client = await make_client(tmp_path)
    client = client_of(http)
    cases = [
        ({"model": "nowhere", "input": "x"}, openai.NotFoundError, "not found"),
        ({"model": "scale", "input": "x"}, openai.BadRequestError, "does not produce embeddings"),
        ({"model": "embed", "input": [[1, 2, 3]]}, openai.BadRequestError, "token arrays"),
        ({"model": "embed", "input": []}, openai.BadRequestError, "non-empty"),
        ({"model": "embed", "input": "x", "dimensions": 8}, openai.BadRequestError, "4-dimensional"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message) as caught:
            await client.embeddings.create(**kwargs)  # type: ignore[arg-type]
        body = caught.value.body
        assert isinstance(body, dict) and body["message"] and body["type"] == "invalid_request_error"
    resp = await http.post("/v1/embeddings", data=b"{not json", headers={"Content-Type": "application/json"})
    error = (await resp.json())["error"]
    assert (
        resp.status == 400
        and error["type"] == "invalid_request_error"
        and "invalid embeddings request" in error["message"]
    )
    metrics = await (await http.get("/metrics")).text()
    assert (
        'scoring_requests_total{code="200",model="embed",protocol="openai",version="1"}' not in metrics
    )  # none ok
    assert 'code="400",model="embed",protocol="openai"' in metrics
    await client.close()


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
async def test_dimensions_gives_the_first_values_normalised_again(
    make_client: MakeClient, tmp_path: Path, encoding_format: Any
) -> None:
    """Matryoshka, as OpenAI and text-embeddings-inference define ``dimensions``: each vector's
    first values, of unit length again; the model's own width gives its vectors as they are."""
    write_embed_model(tmp_path)
    http: Client = await make_client(tmp_path)
    client = client_of(http)
    want = await v2_embeddings(http, TEXTS)
    for dimensions in (2, 3, 4):
        got = await client.embeddings.create(
            model="embed", input=TEXTS, dimensions=dimensions, encoding_format=encoding_format
        )
        vectors = np.array(
            [
                np.frombuffer(base64.b64decode(d.embedding), "<f4")
                if isinstance(d.embedding, str)
                else d.embedding
                for d in got.data
            ],
            np.float32,
        )
        head = want[:, :dimensions]
        assert vectors.shape == (len(TEXTS), dimensions)
        assert np.abs(vectors - head / np.linalg.norm(head, axis=1, keepdims=True)).max() <= 1e-6
        assert np.abs(np.linalg.norm(vectors, axis=1) - 1.0).max() <= 1e-6
    full = await client.embeddings.create(model="embed", input=TEXTS, dimensions=4, encoding_format="float")
    assert np.array([d.embedding for d in full.data], np.float32).tolist() == want.tolist()
    await client.close()


async def test_floats_are_written_in_their_shortest_float32_form(
    make_client: MakeClient, tmp_path: Path
) -> None:
    """Each value of a float embedding is the shortest text that reads back as the same float32
    (at most 9 significant digits), not the 17 digits of the float64 it widens to."""
    write_embed_model(tmp_path)
    http: Client = await make_client(tmp_path)
    want = await v2_embeddings(http, TEXTS)
    raw = await (await http.post("/v1/embeddings", json={"model": "embed", "input": TEXTS})).text()
    rows = re.findall(r'"embedding":\[([^\]]*)\]', raw)
    numbers = [row.split(",") for row in rows]
    assert np.array(numbers, np.float64).astype(np.float32).tolist() == want.tolist()
    assert max(len(re.sub(r"[^0-9]|e.*", "", n).lstrip("0")) for row in numbers for n in row) <= 9


async def test_an_embeddings_request_counts_in_flight_under_its_model(
    make_client: MakeClient, tmp_path: Path
) -> None:
    """Its model is in the body: it enters the in-flight gauge once the handler knows it, and its
    requests are labelled protocol "openai" (the route's, not its path's)."""
    gate = threading.Event()
    ScaleHandler.GATES["embed-in-flight"] = gate
    write_embed_model(tmp_path, load_gate="embed-in-flight")
    http: Client = await make_client(tmp_path, wait=False)
    server_metrics = http.app[CORE].metrics
    assert server_metrics is not None and server_metrics.registry is not None
    metrics = server_metrics.registry
    labels = {"model": "embed", "version": "1"}
    try:
        waiting = asyncio.ensure_future(http.post("/v1/embeddings", json={"model": "embed", "input": "a b"}))
        # it waits in the handler for the model to load
        await eventually(lambda: metrics.get_sample_value("scoring_requests_in_flight", labels) == 1.0)
    finally:
        gate.set()
    assert (await waiting).status == 200
    assert metrics.get_sample_value("scoring_requests_in_flight", labels) == 0.0
    counted = {**labels, "protocol": "openai", "code": "200"}
    assert metrics.get_sample_value("scoring_requests_total", counted) == 1.0


async def test_a_priority_in_the_body_is_the_requests_level(make_client: MakeClient, tmp_path: Path) -> None:
    """vLLM's ``priority`` field: admitted at that level (the per-level metrics count it there),
    refused in OpenAI's error shape where the model has no such level or it is not a level."""
    folder = write_embed_model(tmp_path)
    toml = folder / "model.toml"
    toml.write_text(
        toml.read_text().replace(
            "[[inputs]]", "priority_levels = 2\ndefault_priority_level = 2\n[[inputs]]", 1
        )
    )
    http: Client = await make_client(tmp_path)
    client = client_of(http)
    await client.embeddings.create(model="embed", input=TEXTS, extra_body={"priority": 1})
    await client.embeddings.create(model="embed", input=TEXTS)
    metrics = await (await http.get("/metrics")).text()
    for level in ("1", "2"):
        line = next(
            row for row in metrics.splitlines()
            if row.startswith("scoring_priority_requests_total{") and 'outcome="admitted"' in row
            and f'priority="{level}"' in row
        )  # fmt: skip
        assert float(line.rsplit(" ", 1)[1]) == 1.0, line
    for priority, message in ((3, "priority"), (-1, "whole number")):
        with pytest.raises(openai.BadRequestError, match=message):
            await client.embeddings.create(model="embed", input="x", extra_body={"priority": priority})
    await client.close()


class LastWordsHandler(EmbedHandler):
    """An :class:`EmbedHandler` (a word is a token) that takes ``truncate_prompt_tokens``: k >= 1
    keeps each text's last k words, -1 its last 3 (its maximum length), 0 (not asked) all."""

    def preprocess(self, inputs: Mapping[str, np.ndarray]) -> list[str]:
        keep = inputs["truncate_prompt_tokens"].reshape(-1).tolist()
        texts = super().preprocess(inputs)
        return [
            " ".join(t.split()[-(3 if k == -1 else k) :]) if k else t
            for t, k in zip(texts, keep, strict=True)
        ]


async def test_truncate_prompt_tokens_reaches_a_model_that_takes_it(
    make_client: MakeClient, tmp_path: Path
) -> None:
    """vLLM's ``truncate_prompt_tokens``: the model gets it per item (its last k tokens kept, -1 its
    maximum) and ``usage`` counts what ran; a model that does not take it refuses it, naming
    itself, rather than answering another question; 0 is no length."""
    write_embed_model(tmp_path)
    folder = write_embed_model(tmp_path, "last-words")
    toml = folder / "model.toml"
    toml.write_text(
        toml.read_text()
        .replace("toy_models:EmbedHandler", "test_openai:LastWordsHandler")
        .replace("tests.support.", "tests.unit.")
        + '[[inputs]]\nname = "truncate_prompt_tokens"\ndatatype = "INT64"\nshape = [1]\noptional = true\n'
    )
    http: Client = await make_client(tmp_path)
    client = client_of(http)
    texts = ["one two three four five", "six", "seven eight"]
    for k, tokens in ((None, 8), (2, 2 + 1 + 2), (-1, 3 + 1 + 2)):
        extra = {} if k is None else {"truncate_prompt_tokens": k}
        got = await client.embeddings.create(model="last-words", input=texts, extra_body=extra)
        assert got.usage.prompt_tokens == tokens, k
    cut = await client.embeddings.create(
        model="last-words", input=texts[0], extra_body={"truncate_prompt_tokens": 2}
    )
    whole = await client.embeddings.create(model="last-words", input="four five")
    assert cut.data[0].embedding == whole.data[0].embedding
    with pytest.raises(openai.BadRequestError, match="model 'embed' does not truncate on request"):
        await client.embeddings.create(model="embed", input=texts, extra_body={"truncate_prompt_tokens": 2})
    for bad in (0, -2):
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
            await client.embeddings.create(
                model="last-words", input=texts, extra_body={"truncate_prompt_tokens": bad}
            )
    await client.close()
