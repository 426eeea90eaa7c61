# The kubeinfer image: `kubeinfer serve` (engine), `kubeinfer operator`, `kubeinfer route` (router).
# What the Helm chart runs by default (kubeinfer/kubeinfer:<appVersion>); build it with
#   make image                       # CPU: kubeinfer/kubeinfer:0.1.0
#   make image VARIANT=cuda          # CUDA: kubeinfer/kubeinfer:0.1.0-cuda
# Install steps: docker/install.sh (tests/test_image.py runs the same script into a clean venv).
# Non-root (uid 65532, as the operator's pods run), and read-only-root: at run time it writes
# only under /tmp (HOME, the compiled CPU kernels, Triton's and Hugging Face's caches), which
# the operator mounts as an emptyDir.
ARG VARIANT=cpu
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

FROM python:3.11-slim AS base-cpu
# gcc: the CPU kernels are compiled for the node's CPU when a pod starts (a few CPU-seconds).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV TORCH_INDEX=https://download.pytorch.org/whl/cpu

FROM ${CUDA_IMAGE} AS base-cuda
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH TORCH_INDEX=https://download.pytorch.org/whl/cu130

FROM base-${VARIANT}
COPY pyproject.toml README.md LICENSE /src/
COPY docker /src/docker
COPY server /src/server
COPY kernels /src/kernels
COPY operator /src/operator
RUN PIP_NO_CACHE_DIR=1 bash /src/docker/install.sh /src && rm -rf /src \
    && useradd --uid 65532 --no-create-home --home-dir /tmp kubeinfer
ENV HOME=/tmp TMPDIR=/tmp XDG_CACHE_HOME=/tmp/.cache KUBEINFER_CACHE_DIR=/tmp/kubeinfer \
    TRITON_CACHE_DIR=/tmp/.triton HF_HOME=/tmp/.cache/huggingface PYTHONDONTWRITEBYTECODE=1
USER 65532:65532
ENTRYPOINT ["kubeinfer"]
CMD ["serve", "--host", "0.0.0.0"]
