"""gpu_stat: the NVML adapter (through fake binding modules), the fake backend, the
CUDA_VISIBLE_DEVICES view and the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpu_stat
from gpu_stat import GpuInfo, GpuProcess, NvmlUnavailable, backend_name, query_gpus
from gpu_stat.__main__ import main
from gpu_stat.visible import apply_visible_devices, parse_visible_devices, resolve_entry
from tests.support.fake_gpus import (
    GIB,
    FakeDevice,
    FakeNvmlModule,
    gpu,
    gpu_uuid,
    mig,
    mig_uuid,
    write_fake,
    write_unavailable,
)
from tests.support.gunicorn import ROOT


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "GPU_STAT_FAKE_NVML",
        "GPU_STAT_DISABLE_NVML",
        "GPU_STAT_NVML_BACKEND",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "gpus.json"
    write_fake(
        path,
        [
            gpu(0, memory_used=10 * GIB, processes=[(111, 2 * GIB)]),
            gpu(1, name="Fake H100", utilization=None, processes=None),
            gpu(2, mig=[mig(2, 0), mig(2, 1, memory_used=GIB)]),
        ],
    )
    monkeypatch.setenv("GPU_STAT_FAKE_NVML", str(path))
    return path


def install(monkeypatch: pytest.MonkeyPatch, module: FakeNvmlModule) -> None:
    """Make the fake module importable under its real name and force that backend."""
    monkeypatch.setitem(sys.modules, module.__name__, module)
    backend = "nvidia-ml-py" if module.__name__ == "pynvml" else "py3nvml"
    monkeypatch.setenv("GPU_STAT_NVML_BACKEND", backend)


# --- the real adapter over fake binding modules ---------------------------------------------------


def mig_device(uuid: str) -> FakeDevice:
    return FakeDevice(uuid, name="Fake H100 MIG 1g.10gb", total=10 * GIB, used=0,
                      utilization=None, processes=[(77, GIB)])


def test_nvidia_ml_py_adapter_reads_every_field(monkeypatch: pytest.MonkeyPatch) -> None:
    module = FakeNvmlModule(
        [
            FakeDevice(gpu_uuid(0), processes=[(10, 3 * GIB), (11, None)]),
            FakeDevice(gpu_uuid(1), utilization=None, processes=None),
            FakeDevice(gpu_uuid(2), mig=[mig_device(mig_uuid(2, 0)), mig_device(mig_uuid(2, 1))]),
        ]
    )
    install(monkeypatch, module)

    first, second, third = query_gpus()

    assert backend_name() == "nvidia-ml-py"
    assert first == GpuInfo(
        index=0,
        nvml_index=0,
        uuid=gpu_uuid(0),
        name="Fake H100",
        pci_bus_id="00000000:17:00.0",
        memory_total=80 * GIB,
        memory_used=GIB,
        memory_free=79 * GIB,
        utilization_percent=12,
        processes=(GpuProcess(10, 3 * GIB), GpuProcess(11, None)),
    )
    assert second.utilization_percent is None
    assert second.processes is None  # "not supported" is unknown, not "no process"
    assert third.mig_enabled
    assert [m.uuid for m in third.mig_instances] == [mig_uuid(2, 0), mig_uuid(2, 1)]
    assert third.mig_instances[1].parent_uuid == gpu_uuid(2)
    assert third.mig_instances[1].index == 1
    assert third.mig_instances[1].memory_total == 10 * GIB
    assert third.mig_instances[1].processes == (GpuProcess(77, GIB),)
    assert module.init_count == 0  # every nvmlInit was paired with nvmlShutdown


def test_adapter_falls_back_to_older_process_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    module = FakeNvmlModule(
        [FakeDevice(gpu_uuid(0), processes=[(5, GIB)])],
        missing_in_driver=("nvmlDeviceGetComputeRunningProcesses_v3",),
    )
    install(monkeypatch, module)

    (info,) = query_gpus()

    assert info.processes == (GpuProcess(5, GIB),)
    assert module.calls == [
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
    ]


def test_adapter_reports_unknown_processes_when_no_call_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = FakeNvmlModule(
        [FakeDevice(gpu_uuid(0), processes=[(5, GIB)])],
        missing_in_driver=(
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetComputeRunningProcesses_v2",
            "nvmlDeviceGetComputeRunningProcesses",
        ),
    )
    install(monkeypatch, module)

    assert query_gpus()[0].processes is None


def test_py3nvml_adapter_bytes_and_no_mig_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    module = FakeNvmlModule(
        [FakeDevice(gpu_uuid(0), processes=[(9, 2 * GIB)], mig=[mig_device(mig_uuid(0, 0))])],
        flavour="py3nvml",
        strings_as_bytes=True,
    )
    install(monkeypatch, module)

    (info,) = query_gpus()

    assert backend_name() == "py3nvml"
    assert (info.uuid, info.name, info.pci_bus_id) == (
        gpu_uuid(0),
        "Fake H100",
        "00000000:17:00.0",
    )
    assert info.processes == (GpuProcess(9, 2 * GIB),)
    assert module.calls == ["nvmlDeviceGetComputeRunningProcesses"]
    assert not info.mig_enabled and info.mig_instances == ()


def test_adapter_leaves_out_a_lost_gpu_but_keeps_indices(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    module = FakeNvmlModule([FakeDevice(gpu_uuid(0), lost=True), FakeDevice(gpu_uuid(1))])
    install(monkeypatch, module)

    gpus = query_gpus()

    assert [(g.nvml_index, g.uuid) for g in gpus] == [(1, gpu_uuid(1))]
    assert "GPU 0 left out" in caplog.text
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [g.uuid for g in query_gpus()] == [gpu_uuid(1)]


def test_adapter_init_failure_is_nvml_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeNvmlModule([], init_error=12))

    with pytest.raises(NvmlUnavailable, match="nvmlInit failed: NVML error 12"):
        query_gpus()


def test_no_binding_importable_is_nvml_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # None in sys.modules: ImportError
    monkeypatch.setitem(sys.modules, "py3nvml.py3nvml", None)

    assert backend_name() == "none"
    with pytest.raises(NvmlUnavailable, match="no NVML binding importable"):
        query_gpus()


def test_auto_prefers_nvidia_ml_py_then_py3nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(
        sys.modules, "py3nvml.py3nvml", FakeNvmlModule([FakeDevice(gpu_uuid(3))], flavour="py3nvml")
    )

    assert backend_name() == "py3nvml"
    assert [g.uuid for g in query_gpus()] == [gpu_uuid(3)]


def test_invalid_backend_setting_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_STAT_NVML_BACKEND", "nvsmi")

    with pytest.raises(ValueError, match="GPU_STAT_NVML_BACKEND='nvsmi'"):
        query_gpus()


def test_real_nvml_without_driver_is_unavailable_not_an_error() -> None:
    # On a machine with a driver this lists the real GPUs; without one it must say why.
    try:
        gpus = query_gpus()
    except NvmlUnavailable as exc:
        assert str(exc)
    else:
        assert all(g.memory_total > 0 for g in gpus)


# --- the fake backend -----------------------------------------------------------------------------


def test_fake_backend_snapshot(fake_file: Path) -> None:
    gpus = query_gpus()

    assert backend_name() == f"fake:{fake_file}"
    assert [g.uuid for g in gpus] == [gpu_uuid(0), gpu_uuid(1), gpu_uuid(2)]
    assert gpus[0].memory_free == 70 * GIB
    assert gpus[0].processes == (GpuProcess(111, 2 * GIB),)
    assert gpus[1].utilization_percent is None and gpus[1].processes is None
    assert gpus[1].name == "Fake H100"
    assert gpus[2].mig_enabled
    assert gpus[2].mig_instances[1].memory_free == 9 * GIB
    assert gpus[2].mig_instances[1].parent_uuid == gpu_uuid(2)


def test_fake_backend_rereads_the_file(fake_file: Path) -> None:
    assert len(query_gpus()) == 3
    write_fake(fake_file, [gpu(5)])
    assert [g.uuid for g in query_gpus()] == [gpu_uuid(5)]
    write_unavailable(fake_file, "simulated")
    with pytest.raises(NvmlUnavailable, match="simulated"):
        query_gpus()


def test_disable_env_wins_over_fake(fake_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_STAT_DISABLE_NVML", "1")

    assert backend_name() == "disabled"
    with pytest.raises(NvmlUnavailable, match="GPU_STAT_DISABLE_NVML"):
        query_gpus()
    monkeypatch.setenv("GPU_STAT_DISABLE_NVML", "0")
    assert len(query_gpus()) == 3


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "Expecting property name"),
        ('[{"uuid": "GPU-1"}]', "'memory_total' is required"),
        ('[{"memory_total": 1, "memory_usd": 1}]', "unknown keys \\['memory_usd'\\]"),
        ('[{"uuid": "abc", "memory_total": 1}]', "starting with 'GPU-'"),
        ('[{"memory_total": 1, "memory_used": 2}]', "exceed memory_total"),
        ('[{"memory_total": 1, "processes": [{"pid": -1}]}]', "non-negative integer"),
        ('{"nvml": "maybe"}', '"nvml" must be "unavailable"'),
        ('[{"uuid": "GPU-1", "memory_total": 1}, {"uuid": "GPU-1", "memory_total": 1}]',
         "duplicate uuids"),
    ],
)
def test_fake_backend_rejects_malformed_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str, message: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    monkeypatch.setenv("GPU_STAT_FAKE_NVML", str(path))

    with pytest.raises(ValueError, match=message) as info:
        query_gpus()
    assert str(path) in str(info.value)


def test_fake_backend_missing_file_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPU_STAT_FAKE_NVML", str(tmp_path / "absent.json"))

    with pytest.raises(ValueError, match=r"absent\.json"):
        query_gpus()


# --- CUDA_VISIBLE_DEVICES -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("", []), ("  ", []), ("0,1", ["0", "1"]), (" 1 , GPU-ab ", ["1", "GPU-ab"])],
)
def test_parse_visible_devices(value: str | None, expected: list[str] | None) -> None:
    assert parse_visible_devices(value) == expected


@pytest.fixture
def four_gpus(fake_file: Path) -> list[GpuInfo]:
    write_fake(fake_file, [gpu(0), gpu(1), gpu(2), gpu(3, mig=[mig(3, 0), mig(3, 1)])])
    return query_gpus(respect_visible_devices=False)


def uuids(view: list[GpuInfo]) -> list[str]:
    return [g.uuid for g in view]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2,1", [gpu_uuid(2), gpu_uuid(1)]),
        ("0,2,-1,1", [gpu_uuid(0), gpu_uuid(2)]),  # CUDA's own example: stop at the invalid one
        ("1,7,0", [gpu_uuid(1)]),  # no such index
        ("1,1,0", [gpu_uuid(1)]),  # a repeat ends the list
        ("1,,0", [gpu_uuid(1)]),
        (gpu_uuid(2), [gpu_uuid(2)]),
        (gpu_uuid(2).upper(), [gpu_uuid(2)]),  # matched case-insensitively
        ("GPU-00000001,0", [gpu_uuid(1), gpu_uuid(0)]),  # unique prefix
        ("GPU-0000000,1", []),  # ambiguous prefix
        ("GPU-ffffffff", []),
        (f"{mig_uuid(3, 1)},0", [mig_uuid(3, 1), gpu_uuid(0)]),
        (f"MIG-GPU-{gpu_uuid(3)[4:]}/1/0", []),  # pre-R470 syntax: unsupported
        ("nonsense,0", []),
        ("", []),
    ],
)
def test_apply_visible_devices(four_gpus: list[GpuInfo], value: str, expected: list[str]) -> None:
    view = apply_visible_devices(four_gpus, value)

    assert uuids(view) == expected
    assert [g.index for g in view] == list(range(len(expected)))


def test_visible_view_keeps_nvml_index_and_mig_parent(
    four_gpus: list[GpuInfo], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"2,{mig_uuid(3, 0)}")

    view = query_gpus()

    assert [(g.index, g.nvml_index) for g in view] == [(0, 2), (1, 3)]
    assert view[1].parent_uuid == gpu_uuid(3)
    assert len(query_gpus(respect_visible_devices=False)) == 4


def test_resolve_entry_matches_mig_only_with_mig_prefix(four_gpus: list[GpuInfo]) -> None:
    found = resolve_entry(mig_uuid(3, 0)[:12], four_gpus)
    assert found is not None and found.uuid == mig_uuid(3, 0) and found.parent_uuid == gpu_uuid(3)
    assert resolve_entry("MIG-" + gpu_uuid(3)[4:], four_gpus) is None
    assert resolve_entry("3", four_gpus) is four_gpus[3]


def test_indices_on_mixed_gpus_warn_about_device_order(
    fake_file: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    write_fake(fake_file, [gpu(0, name="Fake A100"), gpu(1, name="Fake T4")])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")

    query_gpus()

    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in caplog.text


# --- command line ---------------------------------------------------------------------------------


def test_cli_json(fake_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json"]) == 0

    data = json.loads(capsys.readouterr().out)
    assert [g["uuid"] for g in data] == [gpu_uuid(0), gpu_uuid(1), gpu_uuid(2)]
    assert data[0]["processes"] == [{"pid": 111, "used_memory": 2 * GIB}]
    assert data[2]["mig_instances"][0]["uuid"] == mig_uuid(2, 0)


def test_cli_table(fake_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"backend: fake:{fake_file}"
    assert lines[1].split() == ["IDX", "NVML", "UUID", "NAME", "USED/TOTAL", "FREE", "UTIL", "PIDS"]
    assert lines[2].split()[:3] == ["0", "0", gpu_uuid(0)]
    assert lines[2].endswith("111")
    assert lines[3].endswith("n/a")  # GPU 1 does not list processes
    assert [line.split()[0] for line in lines[2:]] == ["0", "1", "2", "2.mig0", "2.mig1"]


def test_cli_respects_visible_devices_unless_all(
    fake_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    main(["--json"])
    assert [g["uuid"] for g in json.loads(capsys.readouterr().out)] == [gpu_uuid(1)]
    main(["--json", "--all"])
    assert len(json.loads(capsys.readouterr().out)) == 3


def test_cli_without_nvml_exits_zero(
    fake_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_unavailable(fake_file, "no library here")

    assert main(["--json"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "[]"
    assert err.strip() == "NVML unavailable: no library here"
    assert main([]) == 0
    assert capsys.readouterr().out == ""


def test_cli_malformed_fake_exits_two(fake_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake_file.write_text("[1]")

    assert main([]) == 2
    assert "GPU 0: expected an object" in capsys.readouterr().err


def test_python_m_gpu_stat_runs_as_a_module(tmp_path: Path) -> None:
    env = {**os.environ, "GPU_STAT_DISABLE_NVML": "1", "PYTHONPATH": str(ROOT)}

    done = subprocess.run(
        [sys.executable, "-m", "gpu_stat", "--json"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )

    assert (done.returncode, done.stdout.strip()) == (0, "[]")
    assert done.stderr.startswith("NVML unavailable: disabled by GPU_STAT_DISABLE_NVML=1")


def test_importing_gpu_stat_pulls_in_neither_torch_nor_aiohttp_nor_nvml() -> None:
    code = (
        "import sys, gpu_stat, gpu_stat.binding, gpu_stat.__main__; "
        "bad = {'torch', 'aiohttp', 'pynvml', 'py3nvml'} & set(sys.modules); "
        "print(sorted(bad))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert done.stdout.strip() == "[]"


def test_public_names() -> None:
    assert {"query_gpus", "backend_name", "NvmlUnavailable", "GpuInfo"} <= set(gpu_stat.__all__)
