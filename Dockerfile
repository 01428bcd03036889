# One image for every Tessera service; compose picks the service with `command`.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
RUN pip install . && useradd --create-home --uid 10001 tessera
USER tessera
CMD ["python", "-m", "services.gateway"]
