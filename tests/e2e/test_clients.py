"""Stock clients at their defaults against real gunicorn serving both demo models:
``tritonclient.http`` (binary tensor data both ways by default), ``tritonclient.http.aio``
(sends ``application/octet-stream``), kserve's ``InferenceRESTClient`` V2 and V1. Every
answer must equal the plain JSON path's."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import pytest

from tests.support.demo_repo import MINILM, RANKER
from tests.support.fixtures import DEMO_GROUP
from tests.support.gunicorn import Gunicorn

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group(DEMO_GROUP)]

SENTENCES = ["A man is eating food.", "The stock market fell sharply today.", "héllo wörld"]


@pytest.fixture
def server(demo_server: Gunicorn) -> Gunicorn:
    """The shared demo server (``tests.support.fixtures.demo_server``)."""
    return demo_server


FEATURES = np.random.default_rng(7).normal(size=(4, 32)).astype(np.float32)
TEXTS = np.array([[s.encode()] for s in SENTENCES], dtype=object)


def json_outputs(server: Gunicorn, model: str) -> dict[str, np.ndarray]:
    """The reference: the plain V2 JSON path's outputs."""
    if model == RANKER:
        inputs = [
            {"name": "features", "shape": [4, 32], "datatype": "FP32", "data": FEATURES.ravel().tolist()}
        ]
    else:
        inputs = [{"name": "text", "shape": [3, 1], "datatype": "BYTES", "data": SENTENCES}]
    status, _, body = server.post(f"/v2/models/{model}/infer", {"inputs": inputs})
    assert status == 200, body
    return {o["name"]: np.array(o["data"], dtype=np.float32).reshape(o["shape"]) for o in body["outputs"]}


def assert_same(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def triton_inputs(module: Any, model: str) -> list[Any]:
    if model == RANKER:
        tensor = module.InferInput("features", list(FEATURES.shape), "FP32")
        tensor.set_data_from_numpy(FEATURES)  # binary_data=True: the default
    else:
        tensor = module.InferInput("text", list(TEXTS.shape), "BYTES")
        tensor.set_data_from_numpy(TEXTS)
    return [tensor]


@pytest.mark.parametrize("model", [RANKER, MINILM])
def test_tritonclient_http_defaults(server: Gunicorn, model: str) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(model)
        metadata = client.get_server_metadata()
        assert "binary_tensor_data" in metadata["extensions"]
        config = client.get_model_config(model)
        assert config["name"] == model and config["max_batch_size"] > 0
        result = client.infer(model, triton_inputs(httpclient, model))
        outputs = {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}
        assert all("binary_data_size" in o["parameters"] for o in result.get_response()["outputs"])
        assert_same(outputs, json_outputs(server, model))
        # one output, asked for as JSON
        wanted = [httpclient.InferRequestedOutput(config["output"][0]["name"], binary_data=False)]
        result = client.infer(model, triton_inputs(httpclient, model), outputs=wanted, request_id="r-1")
        assert result.get_response()["id"] == "r-1"
        name = wanted[0].name()
        np.testing.assert_allclose(
            result.as_numpy(name), json_outputs(server, model)[name], rtol=1e-5, atol=1e-6
        )
        stats = client.get_inference_statistics(model)["model_stats"][0]
        assert stats["name"] == model and stats["inference_stats"]["success"]["count"] >= 2
        index = client.get_model_repository_index()
        assert {(m["name"], m["state"]) for m in index} == {(MINILM, "READY"), (RANKER, "READY")}
    finally:
        client.close()


@pytest.mark.parametrize("model", [RANKER, MINILM])
def test_tritonclient_http_aio_defaults(server: Gunicorn, model: str) -> None:
    import tritonclient.http.aio as aioclient

    async def run() -> dict[str, np.ndarray]:
        client = aioclient.InferenceServerClient(f"127.0.0.1:{server.port}")
        try:
            assert await client.is_server_live() and await client.is_model_ready(model)
            assert (await client.get_model_config(model))["name"] == model
            result = await client.infer(model, triton_inputs(aioclient, model))
            return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}
        finally:
            await client.close()

    assert_same(asyncio.run(run()), json_outputs(server, model))


@pytest.mark.parametrize("model", [RANKER, MINILM])
def test_kserve_rest_client_v2_defaults(server: Gunicorn, model: str) -> None:
    from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

    async def run() -> dict[str, np.ndarray]:
        async with InferenceRESTClient(RESTConfig(protocol="v2")) as client:  # closes its connections
            base = server.url
            assert await client.is_server_live(base) and await client.is_server_ready(base)
            assert await client.is_model_ready(base, model)
            data = FEATURES if model == RANKER else TEXTS
            tensor = InferInput(
                "features" if model == RANKER else "text",
                list(data.shape),
                "FP32" if model == RANKER else "BYTES",
            )
            tensor.set_data_from_numpy(data)  # binary_data=True: the default
            response = await client.infer(base, InferRequest(model, [tensor]), model_name=model)
            return {o.name: o.as_numpy() for o in response.outputs}

    assert_same(asyncio.run(run()), json_outputs(server, model))


@pytest.mark.parametrize("model", [RANKER, MINILM])
def test_kserve_rest_client_v1_defaults(server: Gunicorn, model: str) -> None:
    from kserve import InferenceRESTClient, RESTConfig

    instances: list[Any] = FEATURES.tolist() if model == RANKER else SENTENCES

    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        async with InferenceRESTClient(RESTConfig(protocol="v1")) as client:  # closes its connections
            assert await client.is_server_live(server.url)
            assert await client.is_model_ready(server.url, model)
            by_instances = await client.infer(server.url, {"instances": instances}, model_name=model)
            by_inputs = await client.infer(server.url, {"inputs": instances}, model_name=model)
            return by_instances, by_inputs

    by_instances, by_inputs = asyncio.run(run())
    assert by_instances == by_inputs
    expected = json_outputs(server, model)
    if model == RANKER:
        np.testing.assert_allclose(
            np.array(by_instances["predictions"]), expected["click_probability"], rtol=1e-5
        )
    else:
        got = np.array([p["embedding"] for p in by_instances["predictions"]], dtype=np.float32)
        np.testing.assert_allclose(got, expected["embedding"], rtol=1e-5, atol=1e-6)


def test_no_error_tracebacks_in_the_server_log(server: Gunicorn) -> None:
    assert "Traceback" not in server.log(), server.log()[-4000:]


def cosines(got: list[Any], expected: np.ndarray) -> list[float]:
    """Cosine of each returned vector (floats, or base64 of little-endian float32) to its row."""
    out = []
    for vector, want in zip(got, expected, strict=True):
        v = (
            np.frombuffer(base64.b64decode(vector), "<f4")
            if isinstance(vector, str)
            else np.asarray(vector, np.float32)
        )
        out.append(float(v @ want / np.linalg.norm(v) / np.linalg.norm(want)))
    return out


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_openai_client_embeddings_equal_v2(server: Gunicorn, encoding_format: Any) -> None:
    """The stock ``openai`` client's ``embeddings.create`` on MiniLM: the V2 ``embedding`` rows
    for a string and for a list, usage = the V2 ``tokens`` output summed; bad input gets OpenAI's
    error shape with a 4xx."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    try:
        expected = json_outputs(server, MINILM)
        one = client.embeddings.create(model=MINILM, input=SENTENCES[0], encoding_format=encoding_format)
        many = client.embeddings.create(model=MINILM, input=SENTENCES, encoding_format=encoding_format)
        assert min(cosines([one.data[0].embedding], expected["embedding"][:1])) >= 0.99999
        assert min(cosines([d.embedding for d in many.data], expected["embedding"])) >= 0.99999
        assert [d.index for d in many.data] == [0, 1, 2]
        assert many.usage.prompt_tokens == int(expected["tokens"].sum()) > 0
        assert one.usage.prompt_tokens == int(expected["tokens"][0, 0]) == 8  # [CLS] a man ... . [SEP]
        with pytest.raises(openai.BadRequestError) as bad:
            client.embeddings.create(model=MINILM, input=[[101, 2023]])  # token ids: not taken
        assert bad.value.status_code == 400 and "token" in bad.value.message
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="no-such-model", input="x")
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(model=RANKER, input="x")  # no embedding output
    finally:
        client.close()
