"""What a worker imports before its models load, and what loading a TorchScript model adds: none
of the packages that cost seconds of CPU and serve no model of the worker's (docs/benchmarks.md,
*Start to ready*), each checked in a fresh interpreter (this process has imported them all); and
the start-to-ready benchmark's arithmetic (benchmarks.startup): -X importtime read back, split
at the fork, summed per package; the starts' min/median/max."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import startup
from tests.support.gunicorn import ROOT

#: Imported only where a model needs them: torch's compiler stack (the ``.pt2`` loader),
#: the sentence-transformers stack, ONNX Runtime, OpenTelemetry's SDK.
HEAVY = (
    "torch._dynamo", "torch._inductor", "sympy", "torch.distributed.tensor", "sentence_transformers",
    "transformers", "sklearn", "scipy", "pandas", "onnxruntime", "opentelemetry.sdk",
)  # fmt: skip
#: A worker's import path up to its first model load: the worker class, the app, the serving
#: core, the model formats, the gRPC front end and the observability modules.
WORKER_PATH = (
    "app.server.worker", "app.main", "app.serving.executor", "app.serving.control",
    "app.models.torch_formats", "app.models.onnx_format", "app.onnx_session", "app.grpc.server",
    "app.observability.tracing", "app.observability.gpu", "app.observability.logconfig",
    "app.observability.looplag",
)  # fmt: skip


def imported_after(code: str) -> set[str]:
    """The modules of :data:`HEAVY` in ``sys.modules`` after ``code`` runs in a new interpreter."""
    probe = f"{code}\nimport sys\nprint('\\n'.join(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_the_worker_import_path_leaves_out_what_only_some_models_need() -> None:
    assert imported_after("\n".join(f"import {m}" for m in WORKER_PATH)) == set()


def test_a_torchscript_model_loads_without_the_compiler_stack(tmp_path: Path) -> None:
    """The ``.pt2`` loader (``torch.export.load``) imports torch's compiler stack when a
    ``torch_export`` model loads (about 2 CPU-s); a TorchScript model needs none of it."""
    torch = pytest.importorskip("torch")
    torch.jit.script(torch.nn.Linear(4, 1)).save(str(tmp_path / "model.pt"))
    (tmp_path / "model.toml").write_text(
        'name = "linear"\nformat = "torchscript"\nfile = "model.pt"\nmax_batch_size = 8\n'
        '[[inputs]]\nname = "x"\ndatatype = "FP32"\nshape = [4]\n'
        '[[outputs]]\nname = "y"\ndatatype = "FP32"\nshape = [1]\n'
    )
    code = (
        "import numpy as np, torch\n"
        "from pathlib import Path\nfrom app.models.repository import read_config\n"
        "from app.models.torch_formats import TorchScriptHandler\n"
        "handler = TorchScriptHandler()\n"
        f"handler.load(torch.device('cpu'), read_config(Path({str(tmp_path)!r})))\n"
        "batch = handler.preprocess({'x': np.zeros((2, 4), np.float32)})\n"
        "assert handler.postprocess(handler.predict(batch))['y'].shape == (2, 1)"
    )
    assert imported_after(code) == set()


IMPORT_LOG = """\
import time: self [us] | cumulative | imported package
import time:       100 |        100 |   gunicorn.util
import time:       200 |        300 | gunicorn
[2026-11-27 14:14:22 +0000] [21258] [INFO] gunicorn.error: Booting worker with pid: 21258
import time:       900 |        900 |     torch._C
import time:      1000 |       1900 |   torch
import time:        50 |       1950 | app.serving.control
import time:      3000 |       3000 |   transformers
import time:       400 |       3400 | sentence_transformers
import time:         7 |          7 | json.decoder
"""


def test_importtime_is_split_at_the_fork_and_summed_per_package() -> None:
    master, worker = startup.split_at_fork(IMPORT_LOG)
    assert [i.module for i in startup.parse_importtime(master)] == ["gunicorn.util", "gunicorn"]
    imports = startup.parse_importtime(worker)
    assert imports[0] == startup.Import("torch._C", 900, 900, 2)
    assert startup.by_package(imports) == {
        "transformers": 0.003, "torch": 0.0019, "sentence_transformers": 0.0004, "app": 5e-05, "stdlib": 7e-06,
    }  # fmt: skip
    assert startup.entry_points(imports, 2) == {
        "sentence_transformers": 0.0034,
        "app.serving.control": 0.00195,
    }


def test_start_figures_are_summed_up_as_min_median_max(tmp_path: Path) -> None:
    starts = [
        {
            "ready_s": r,
            "all_workers_s": r + 1,
            "models_s": {"m": r},
            "worker_cpu_s": [r, 2 * r],
            "master_cpu_s": 0.4,
        }
        for r in (3.0, 1.0, 2.0)
    ]
    got = startup.summary(starts)
    assert got["ready_s"] == {"min": 1.0, "median": 2.0, "max": 3.0}
    assert got["all_workers_s"]["median"] == 3.0 and got["models_s"]["m"]["max"] == 3.0
    assert got["worker_cpu_s"] == {"min": 1.0, "median": 2.5, "max": 6.0}  # every worker of every start
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "model.toml").write_text("")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "model.toml").write_text("")
    (tmp_path / "notes").mkdir()
    assert startup.models_of(tmp_path, "") == ["a", "b"]
    assert startup.models_of(tmp_path, "x,y") == ["x", "y"]
