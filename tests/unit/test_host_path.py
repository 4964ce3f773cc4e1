"""The host-path benchmark's pure parts: py-spy stacks mapped to stages (benchmarks.stages), the
CPU shared out per thread and per item, the loop-lag histogram read back, the load clients'
bookkeeping (benchmarks.loadgen), and the requests of every protocol, accepted by the server's
decoders. One short run of the client processes against an in-process server."""

from __future__ import annotations

import asyncio
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from app.models.repository import read_config
from app.protocols import v2
from app.serving.dataplane import validate_inputs
from benchmarks import host_path, loadgen, payloads, server, stages
from benchmarks.loadgen import LoadResult, Request

REPOSITORY = server.DEMO_REPOSITORY

#: A py-spy ``--threads --format raw`` profile: one stack a line, root first, then its count.
LOOP = "thread (101): MainThread;<module> (gunicorn/__main__.py:10);BaseEventLoop._run_once (asyncio/base_events.py:1922)"
INFER = (
    LOOP
    + ";edge_middleware.<locals>.edge (app/http/edge.py:206);DataPlane.infer (app/serving/dataplane.py:279)"
)
WORKER = (
    "thread (202): inference;Thread.run (threading.py:982);InferenceThread._run (app/serving/executor.py:700)"
)
PROFILE = "\n".join(
    [
        f"{LOOP};RequestHandler._handle_request (aiohttp/web_protocol.py:577) 10",
        f"{INFER};decode_request (app/protocols/v2.py:140);asarray (numpy/_core/numeric.py:12) 4",
        f"{INFER};validate_inputs (app/serving/dataplane.py:445);check_against_spec (app/protocols/tensors.py:9) 3",
        f"{INFER};WindowStage.expand (app/serving/windows.py:80) 2",
        f"{INFER};ServingUnit.infer (app/serving/unit.py:300);RequestQueue.put (app/serving/queue.py:120) 5",
        f"{INFER};encode_response (app/protocols/v2.py:170);JSONEncoder.iterencode (json/encoder.py:258) 6",
        f"{INFER};Counter.inc (prometheus_client/metrics.py:310) 1",
        f"{WORKER};ModelRunner.forward (app/serving/executor.py:400);SentenceEmbeddingHandler.preprocess "
        "(app/handlers/sentence_embedding.py:200);TokenizersBackend._encode_plus "
        "(transformers/tokenization_utils_tokenizers.py:600) 7",
        f"{WORKER};SentenceEmbeddingHandler.predict (app/handlers/sentence_embedding.py:250);"
        "BertModel.forward (transformers/models/bert/modeling_bert.py:900);Linear.forward "
        "(torch/nn/modules/linear.py:125) 20",
        f"{WORKER};SentenceEmbeddingHandler.postprocess (app/handlers/sentence_embedding.py:280) 2",
        "thread (303): other;<module> (somewhere.py:1) 1",
        "a line py-spy would not write",
    ]
)


def test_each_sample_counts_as_the_stage_of_its_leaf_most_named_frame() -> None:
    samples = stages.split(stages.parse_raw(PROFILE))
    assert samples == {
        "edge": 10,
        "decode": 4,  # numpy names no stage: its caller decodes
        "validation": 3,
        "items": 2,
        "batching": 5,
        "tokenizing": 7,
        "forward": 20,
        "postprocess": 2,
        "encode": 6,
        "metrics": 1,
        "native": 0,
        "other": 1,
    }
    assert list(samples) == list(stages.STAGES)


def test_frames_and_threads_are_read_from_the_raw_format() -> None:
    assert stages.frame_of("DataPlane.infer (app/serving/dataplane.py:279)") == (
        "DataPlane.infer",
        "app/serving/dataplane.py",
    )
    assert stages.frame_of("<module> (<frozen runpy>:88)") == ("<module>", "<frozen runpy>")
    assert stages.frame_of("thread (101): MainThread") == ("thread (101): MainThread", "")
    parsed = stages.parse_raw(PROFILE)
    assert sum(parsed.values()) == 61  # the malformed line is skipped
    assert {stages.thread_of(stack) for stack in parsed} == {101, 202, 303}
    assert stages.thread_of([("main", "x.py")]) is None
    assert stages.thread_of([("thread (0x1f): name", "")]) == 31


def test_each_threads_cpu_is_shared_among_its_own_samples_stages() -> None:
    threads = stages.by_thread(stages.parse_raw(PROFILE))
    assert threads[202]["forward"] == 20 and threads[202]["edge"] == 0
    cpu = stages.cpu_by_stage(
        threads,
        {101: 0.31, 202: 2.9, 404: 0.05, 505: 0.02},  # 303 used no CPU in the window
        {404: "grpc_global_tim", 505: "python"},  # threads without Python samples
    )
    assert cpu["edge"] == pytest.approx(0.31 * 10 / 31 + 0.05)  # gRPC core's thread by its name
    assert cpu["forward"] == pytest.approx(2.9 * 20 / 29)
    assert cpu["tokenizing"] == pytest.approx(2.9 * 7 / 29)
    assert cpu["native"] == pytest.approx(0.02)  # no Python frame, no known name
    assert cpu["other"] == 0.0  # 303's sample weighs nothing: no CPU measured
    assert sum(cpu.values()) == pytest.approx(0.31 + 2.9 + 0.05 + 0.02)


def test_a_thread_woken_for_work_and_waiting_for_the_gil_gets_none_of_its_cpu() -> None:
    waits = PROFILE + f"\n{WORKER} 29\nthread (202): inference;_worker (concurrent/futures/thread.py:81) 3"
    parsed = stages.parse_raw(waits)
    assert stages.split(parsed) == stages.split(stages.parse_raw(PROFILE))
    threads = stages.by_thread(parsed)
    assert sum(threads[202].values()) == 29  # its work's samples only
    cpu = stages.cpu_by_stage(threads, {202: 2.9}, {})
    assert cpu["forward"] == pytest.approx(2.9 * 20 / 29)  # not 2.9 * 20 / 61
    assert cpu["batching"] == 0.0


def test_per_item_figures() -> None:
    per_item = stages.per_item_us({"edge": 0.5, "forward": 1.5}, items=1000)
    assert per_item == {"edge": 500.0, "forward": 1500.0}
    assert stages.per_item_us({"edge": 0.5}, items=0) == {"edge": 0.0}


def test_the_top_frames_of_a_stage_are_its_leaf_most_named_ones() -> None:
    parsed = stages.parse_raw(PROFILE)
    assert stages.top_frames(parsed, "decode") == [("decode_request (app/protocols/v2.py)", 4)]
    assert stages.top_frames(parsed, "forward", 1) == [("Linear.forward (torch/nn/modules/linear.py)", 20)]


def metrics_text(pid: str, counts: dict[str, int], longest: float) -> str:
    lines = [
        f'scoring_event_loop_lag_seconds_bucket{{le="{le}",pid="{pid}"}} {n}' for le, n in counts.items()
    ]
    lines += [
        "# TYPE scoring_event_loop_lag_max_seconds gauge",
        f'scoring_event_loop_lag_max_seconds{{pid="{pid}"}} {longest}',
    ]
    return "# TYPE scoring_event_loop_lag_seconds histogram\n" + "\n".join(lines) + "\n"


def test_the_longest_stall_is_the_highest_bucket_that_gained_ticks() -> None:
    before = metrics_text("7", {"0.01": 100, "0.05": 100, "0.25": 101, "+Inf": 101}, 0.2)
    after = metrics_text("7", {"0.01": 180, "0.05": 185, "0.25": 186, "+Inf": 186}, 0.04)
    assert host_path.stalls(before, after) == {"7": [0.01, 0.05]}  # the old 0.25 s is not this run's
    assert host_path.lag_max(after) == {"7": 0.04}
    long = metrics_text("7", {"0.01": 180, "0.05": 185, "0.25": 186, "+Inf": 190}, 3.0)
    assert host_path.stalls(after, long) == {"7": [0.25, math.inf]}
    assert host_path.stalls(after, after) == {"7": None}  # no tick between the scrapes
    assert host_path.stall_text({"7": [0.01, 0.05], "8": [0.25, math.inf], "9": None}) == "10-50, > 250"


def test_load_figures_are_per_item_answered() -> None:
    result = LoadResult("wrk", 64, 2.0, ok=100, statuses={"503": 3}, p50_ms=1.0, p99_ms=9.0, client_cpu_s=0.4)
    row = result.figures(items=8)
    assert (row["items_per_s"], row["errors"], row["client_cpu_us_per_item"]) == (400.0, 3, 500.0)
    assert math.isnan(LoadResult("wrk", 1, 1.0, 0, {}, 0, 0, 0.1).figures(8)["client_cpu_us_per_item"])
    assert loadgen.shares(64, 3) == [22, 21, 21]
    assert loadgen.shares(2, 4) == [1, 1]


def test_wrk_figures_come_from_the_scripts_json_line() -> None:
    said = (
        "Running 5s test @ http://127.0.0.1:1\n"
        '{"requests": 1000, "duration_us": 5000000, "connect": 0, "read": 1, "write": 0, "status": 4, '
        '"timeout": 2, "p50_us": 1500, "p99_us": 9000, "max_us": 12000}\n'
    )
    result = loadgen.wrk_result(said, 64, cpu_s=0.25)
    assert (result.ok, result.statuses, result.elapsed_s) == (996, {"non-2xx": 4, "socket": 3}, 5.0)
    assert (result.p50_ms, result.p99_ms, result.client_cpu_s) == (1.5, 9.0, 0.25)
    with pytest.raises(ValueError, match="wrk printed no figures"):
        loadgen.wrk_result("unable to connect", 64, 0.0)


def test_wrk_reads_the_requests_as_written(tmp_path: Path) -> None:
    requests = [Request("/a", b"\x00\r\n\xff"), Request("/b", b"{}", {"X-One": "1", "X-Two": "2"})]
    loadgen.write_requests(tmp_path, requests)
    assert (tmp_path / "requests.bin").read_bytes() == b"\x00\r\n\xff{}"
    assert (tmp_path / "requests.tsv").read_text().splitlines() == [
        "/a\t4\tContent-Type: application/json",
        "/b\t2\tX-One: 1\tX-Two: 2",
    ]
    with pytest.raises(ValueError, match="tab or line break"):
        loadgen.write_requests(tmp_path, [Request("/a", b"", {"X": "a\tb"})])


@pytest.mark.parametrize("model", [server.RANKER, server.MINILM])
def test_every_protocols_requests_are_what_the_server_decodes(model: str) -> None:
    config = read_config(REPOSITORY / model)
    inputs = host_path.case_inputs(REPOSITORY, model, 8, 2)
    sent = {t.name: t.array for t in inputs[0]}
    as_json = host_path.requests_for(model, "v2-json", inputs)[0]
    binary = host_path.requests_for(model, "v2-binary", inputs)[0]
    head, raw = v2.split_body(binary.body, binary.headers["Inference-Header-Content-Length"])
    from_binary = v2.decode_request(bytes(head), model)
    v2.attach_binary(from_binary, raw)
    for request in (v2.decode_request(as_json.body, model), from_binary):
        assert [o.name for o in request.outputs or ()] == list(host_path.OUTPUTS[model])
        decoded = validate_inputs(config, request)
        assert all(decoded[name].tolist() == array.tolist() for name, array in sent.items())
    message = host_path.requests_for(model, "grpc", inputs)[0]
    assert (
        message.path == loadgen.MODEL_INFER
        and message.body
        == payloads.grpc_request(model, inputs[0], host_path.OUTPUTS[model]).SerializeToString()
    )
    if model == server.MINILM:
        texts = json.loads(host_path.requests_for(model, "embeddings", inputs)[0].body)["input"]
        assert len(texts) == 8 and all(5 <= len(t.split()) <= 15 for t in texts)
    else:
        with pytest.raises(ValueError, match="not measured"):
            host_path.requests_for(model, "embeddings", inputs)


def test_the_repository_copy_admits_by_capacity(tmp_path: Path) -> None:
    copy = host_path.repository_copy(REPOSITORY, [server.RANKER], tmp_path)
    config = read_config(copy / server.RANKER)
    assert (config.admission, config.timeout_ms) == ("capacity", 60000)
    assert config.weights_path().is_file()
    wider = host_path.repository_copy(REPOSITORY, [server.MINILM], tmp_path / "wider", max_batch_size=128)
    config = read_config(wider / server.MINILM)
    assert config.max_batch_size == 128 and max(config.warmup_batch_sizes) == 128


async def test_client_processes_report_per_tag_and_their_own_cpu(aiohttp_server: Any) -> None:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=200 if request.path == "/ok" else 503, text=request.path)

    app = web.Application()
    app.router.add_post("/{name}", answer)
    srv = await aiohttp_server(app)
    requests = [Request("/ok", b"{}", tag="fine"), Request("/no", b"{}", tag="refused")]
    result = await asyncio.get_running_loop().run_in_executor(
        None, loadgen.run_processes, str(srv.make_url("")).rstrip("/"), requests, 4, 1.0, 2
    )
    assert result.client == "processes" and result.ok > 0 and result.statuses["503"] > 0
    assert set(result.by_tag) == {"fine"} and result.by_tag["fine"]["ok"] == result.ok
    assert result.said == {"503": "/no"}
    assert result.client_cpu_s > 0 and 0.9 < result.elapsed_s < 30


def test_a_text_tensor_is_one_text_per_item() -> None:
    tensor = payloads.text_tensor(["a b", "c"])
    assert (tensor.datatype, tensor.array.shape, tensor.array.ravel().tolist()) == (
        "BYTES",
        (2, 1),
        [b"a b", b"c"],
    )
    rng = random.Random(0)
    assert payloads.tensors(payloads.inputs_of(REPOSITORY, server.RANKER), 2, rng)[0].array.shape == (2, 32)
