"""What a worker imports before its models load, and what loading a TorchScript model adds: none
of the packages that cost seconds of CPU and serve no model of the worker's (docs/benchmarks.md,
*Start to ready*). Each check runs in a fresh interpreter: this process has imported them all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
