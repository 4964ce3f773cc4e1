"""``format = "onnx"`` in process: parity with ``torch_export`` on the same weights, the graph
checked against model.toml at load (each bad file a clear ModelLoadError naming the file
relative to the repository), threads, providers, parameters, and serving through the app
(metadata, Triton's config, a repository with broken ONNX files beside a good one).

What only a GPU shows (the CUDA provider, I/O binding, parity with the CPU): tests/gpu/test_onnx_gpu.py.
Under gunicorn, with the demo models: tests/e2e/test_onnx.py.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from app.errors import ModelLoadError
from app.models.loading import resolve_handler
from app.models.onnx_format import OnnxHandler
from app.models.repository import read_config
from app.onnx_session import CPU, CUDA, open_session, providers
from app.protocols.triton import model_config
from app.serving.runner import ModelRunner
from tests.support.fixtures import Client, MakeClient, settled_readiness
from tests.support.onnx_models import (
    ONNX_FILE,
    export_onnx_ranker,
    tiny_ranker_graph,
    write_broken_onnx_models,
    write_onnx_model,
)
from tests.support.toy_models import TENSOR_TOML, TinyRanker, assert_no_absolute_paths, write_tensor_model

FEATURES = np.random.default_rng(3).normal(size=(16, 4)).astype(np.float32)


def runner(folder: Path, *, warm: bool = True) -> ModelRunner:
    loaded = ModelRunner(read_config(folder))
    loaded.load(torch.device("cpu"))
    if warm:
        loaded.warmup()
    return loaded


def expected(features: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        out: np.ndarray = TinyRanker().eval()(torch.from_numpy(features)).numpy()
    return out


# --- parity ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TinyRanker as .pt2 and as .onnx (torch.onnx.export) in one repository."""
    repo = tmp_path_factory.mktemp("onnx_parity")
    write_tensor_model(repo, "ranker-pt2", "torch_export")
    export_onnx_ranker(repo, "ranker-onnx")
    return repo


@pytest.mark.parametrize("items", [1, 7, 16])
def test_exported_onnx_equals_torch_export(exported: Path, items: int) -> None:
    pt2, onnx = runner(exported / "ranker-pt2"), runner(exported / "ranker-onnx")
    inputs = {"features": FEATURES[:items]}
    got, want = onnx.forward(inputs)["probability"], pt2.forward(inputs)["probability"]
    assert got.shape == (items, 1) and got.dtype == np.float32
    assert float(np.abs(got - want).max()) <= 1e-5
    np.testing.assert_allclose(got, expected(FEATURES[:items]), atol=1e-6)


def test_a_hand_written_graph_serves_and_extra_outputs_are_not_fetched(tmp_path: Path) -> None:
    folder = write_onnx_model(tmp_path, "ranker", tiny_ranker_graph(extra_output=True))
    loaded = runner(folder)
    out = loaded.forward({"features": FEATURES})
    assert set(out) == {"probability"}
    np.testing.assert_allclose(out["probability"], expected(FEATURES), atol=1e-6)
    assert resolve_handler(loaded.config).__class__ is OnnxHandler
    assert loaded.config.platform == "onnxruntime_onnx"
    assert not isinstance(loaded.handler, OnnxHandler) or not loaded.handler.io_binding  # CPU: no binding


# --- the graph against model.toml ------------------------------------------------------------


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    repo = tmp_path_factory.mktemp("onnx_broken")
    return repo, write_broken_onnx_models(repo)


@pytest.mark.parametrize(
    "name",
    [
        "onnx-truncated",
        "onnx-not-onnx",
        "onnx-input-name",
        "onnx-dtype",
        "onnx-output-shape",
        "onnx-output-runtime",
        "onnx-fixed-batch",
    ],
)
def test_each_bad_file_is_refused_with_its_reason(broken: tuple[Path, dict[str, str]], name: str) -> None:
    repo, reasons = broken
    with pytest.raises(ModelLoadError) as caught:
        runner(repo / name)
    message = str(caught.value)
    assert reasons[f"{name}/1"] in message, message
    assert message.startswith(f"model {name}: "), message
    assert_no_absolute_paths(message, repo)


def _toml(**replace: str) -> str:
    text = TENSOR_TOML
    for old, new in replace.items():
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize(
    ("graph", "toml", "reason"),
    [
        # a declared variable dim against a fixed one: the graph takes only that size
        ({}, {"shape = [4]": "shape = [-1]"}, r"axis 1 is fixed at 4 in the graph \(declare shape = \[4\]\)"),
        (
            {},
            {"shape = [4]": "shape = [4, 1]"},
            r"rank 2\), but model.toml declares \[batch, 4, 1\] \(rank 3",
        ),
        (
            {},
            {'name = "probability"': 'name = "score"'},
            r"declares output 'score', but .* no output of that name",
        ),
        ({"output_name": "score"}, {}, r"its outputs: \['score'\]"),
        (
            {},
            {'datatype = "FP32"\nshape = [1]': 'datatype = "FP64"\nshape = [1]'},
            "output 'probability' is FP64",
        ),
        # a graph input fixed at batch 1 serves only with max_batch_size = 1
        ({"batch": 1}, {}, r"fixed batch axis of 1 .* or set max_batch_size = 1"),
    ],
)
def test_graph_and_model_toml_must_agree(
    tmp_path: Path, graph: dict[str, Any], toml: dict[str, str], reason: str
) -> None:
    folder = write_onnx_model(tmp_path, "ranker", tiny_ranker_graph(**graph), _toml(**toml))
    with pytest.raises(ModelLoadError, match=reason):
        runner(folder, warm=False)


def test_a_graph_fixed_at_batch_1_serves_with_max_batch_size_1(tmp_path: Path) -> None:
    toml = _toml(**{"max_batch_size = 16": "max_batch_size = 1", "[1, 16]": "[1]"})
    folder = write_onnx_model(tmp_path, "ranker", tiny_ranker_graph(batch=1), toml)
    np.testing.assert_allclose(
        runner(folder).forward({"features": FEATURES[:1]})["probability"], expected(FEATURES[:1]), atol=1e-6
    )


def test_an_input_the_graph_needs_but_model_toml_lacks_is_named(tmp_path: Path) -> None:
    toml = _toml(
        **{'name = "features"': 'name = "features"\ndatatype = "FP32"\nshape = [4]\n[[inputs]]\nname = "x"'}
    )
    folder = write_onnx_model(tmp_path, "ranker", tiny_ranker_graph(), toml)
    with pytest.raises(ModelLoadError, match=r"declares input 'x', but ranker/model.onnx has no input"):
        runner(folder, warm=False)
    graph_input_x = tiny_ranker_graph(input_name="x")
    text = _toml(**{'name = "features"': 'name = "x"'})
    text = text.replace(
        "[[outputs]]", '[[inputs]]\nname = "features"\ndatatype = "FP32"\nshape = [4]\n[[outputs]]'
    )
    write_onnx_model(tmp_path, "two", graph_input_x, text)
    with pytest.raises(ModelLoadError, match=r"declares input 'features', but two/model\.onnx"):
        runner(tmp_path / "two", warm=False)


def test_bytes_tensors_are_refused_with_the_way_out(tmp_path: Path) -> None:
    text = _toml(**{'datatype = "FP32"\nshape = [4]': 'datatype = "BYTES"\nshape = [1]'})
    folder = write_onnx_model(tmp_path, "ranker", tiny_ranker_graph(), text)
    with pytest.raises(ModelLoadError, match=r"BYTES tensors \['features'\] .* backend = 'onnx'"):
        runner(folder, warm=False)


def test_a_missing_file_is_named_relative_to_the_repository(tmp_path: Path) -> None:
    folder = write_onnx_model(tmp_path, "ranker")
    (folder / ONNX_FILE).unlink()
    with pytest.raises(ModelLoadError, match=r"^model ranker: weights file ranker/model.onnx not found$"):
        runner(folder, warm=False)


def test_parameters_are_checked(tmp_path: Path) -> None:
    folder = write_onnx_model(tmp_path, "ranker", toml=TENSOR_TOML + "[parameters]\ntensort = true\n")
    with pytest.raises(ModelLoadError, match=r"unknown \[parameters\] \['tensort'\]; format 'onnx' reads"):
        runner(folder, warm=False)
    folder = write_onnx_model(tmp_path, "other", toml=TENSOR_TOML + '[parameters]\ntensorrt = "yes"\n')
    with pytest.raises(ModelLoadError, match="tensorrt must be true or false"):
        runner(folder, warm=False)


def test_cuda_graphs_do_not_apply_to_onnx(tmp_path: Path) -> None:
    folder = write_onnx_model(
        tmp_path, "ranker", toml=_toml(**{"[1, 16]": "[1, 16]\ncuda_graph_batch_sizes = [1]"})
    )
    with pytest.raises(
        ModelLoadError, match="applies to torch_export and torchscript models and the text handlers, not onnx models"
    ):
        read_config(folder)


# --- threads and providers -----------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2])
def test_intra_op_threads_are_the_loading_threads_torch_threads(tmp_path: Path, threads: int) -> None:
    """The server sets torch's threads on the inference thread that runs ``load``."""
    folder = write_onnx_model(tmp_path, "ranker")
    with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,)) as pool:
        loaded = pool.submit(runner, folder).result()
    assert isinstance(loaded.handler, OnnxHandler)
    options = loaded.handler.session.get_session_options()
    assert options.intra_op_num_threads == threads and options.inter_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert loaded.handler.session.get_providers() == [CPU]


def test_providers_per_device() -> None:
    assert providers(torch.device("cpu")) == [CPU]
    import onnxruntime

    if CUDA in onnxruntime.get_available_providers():
        assert providers(torch.device("cuda:0")) == [(CUDA, {"device_id": 0}), CPU]
    else:
        with pytest.raises(ModelLoadError, match=r"no CUDAExecutionProvider .* install onnxruntime-gpu"):
            providers(torch.device("cuda:0"))
    if "TensorrtExecutionProvider" not in onnxruntime.get_available_providers():
        with pytest.raises(ModelLoadError, match=r"no TensorrtExecutionProvider"):
            providers(torch.device("cuda:1"), tensorrt=True)


def test_open_session_hides_the_absolute_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.onnx"
    path.write_bytes(b"\x00\x01garbage")
    with pytest.raises(ModelLoadError) as caught:
        open_session(path, "m/bad.onnx", torch.device("cpu"), 1)
    assert "m/bad.onnx" in str(caught.value) and str(tmp_path) not in str(caught.value)


def test_handler_needs_load_first() -> None:
    with pytest.raises(RuntimeError, match=r"load\(\) has not been called"):
        OnnxHandler().predict({})


def test_predict_runs_only_the_graph_and_close_drops_it(tmp_path: Path) -> None:
    loaded = runner(write_onnx_model(tmp_path, "ranker"))
    handler = loaded.handler
    assert isinstance(handler, OnnxHandler)
    batch = handler.preprocess({"features": FEATURES.astype(np.float64)})  # cast to the declared dtype
    assert batch["features"].dtype == np.float32 and batch["features"].flags.c_contiguous
    outputs = handler.postprocess(handler.predict(batch))
    np.testing.assert_allclose(outputs["probability"], expected(FEATURES), atol=1e-6)
    seen: list[str] = []
    thread = threading.Thread(target=lambda: seen.append(str(loaded.close())))
    thread.start()
    thread.join()
    assert seen == ["0"]


# --- served in process ----------------------------------------------------------------------


async def test_served_with_its_platform_backend_and_broken_twins_unavailable(
    make_client: MakeClient, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    write_onnx_model(repo, "ranker")
    reasons = write_broken_onnx_models(repo)
    client: Client = await make_client(repo, wait=False, strict_readiness=False)
    ready = await settled_readiness(client)
    assert set(ready["unavailable"]) == set(reasons), ready
    for name, reason in reasons.items():
        assert reason in ready["unavailable"][name], (name, ready["unavailable"][name])
    index = await (await client.post("/v2/repository/index")).json()
    states = {m["name"]: (m["state"], m.get("reason", "")) for m in index}
    assert states["ranker"][0] == "READY"
    for name, reason in reasons.items():
        state, why = states[name.split("/")[0]]
        assert state == "UNAVAILABLE" and reason in why, (name, state, why)
    assert_no_absolute_paths(json.dumps(ready) + json.dumps(index), repo)

    body = {
        "inputs": [
            {"name": "features", "shape": [16, 4], "datatype": "FP32", "data": FEATURES.ravel().tolist()}
        ]
    }
    resp = await client.post("/v2/models/ranker/infer", json=body)
    assert resp.status == 200
    out = await resp.json()
    got = np.array(out["outputs"][0]["data"], dtype=np.float32).reshape(16, 1)
    np.testing.assert_allclose(got, expected(FEATURES), atol=1e-6)
    meta = await (await client.get("/v2/models/ranker")).json()
    assert meta["platform"] == "onnxruntime_onnx"
    config = await (await client.get("/v2/models/ranker/config")).json()
    assert (config["platform"], config["backend"]) == ("onnxruntime_onnx", "onnxruntime")


def test_triton_config_names_the_onnxruntime_backend(tmp_path: Path) -> None:
    config = read_config(write_onnx_model(tmp_path, "ranker"))
    document = model_config(config, "cpu")
    assert document["backend"] == "onnxruntime" and document["platform"] == "onnxruntime_onnx"
    assert msgspec.json.decode(msgspec.json.encode(document))["input"][0]["dims"] == [4]
