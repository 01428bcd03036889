"""Settings, read once at start from the environment and passed down.

Shared values use one name for every service (``TESSERA_NATS_URL``, ``TESSERA_REDIS_URL``,
``TESSERA_LOG_LEVEL``, ``TESSERA_OTLP_ENDPOINT``); each service's own values carry its prefix
(``TESSERA_SCHEDULER_CYCLE_MS``, ``TESSERA_GATEWAY_PORT``, …). This is the only module that
reads the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _shared(name: str) -> AliasChoices:
    return AliasChoices(name.lower().removeprefix("tessera_"), name)


class ServiceSettings(BaseSettings):
    """What every service needs. Subclasses set ``env_prefix`` to ``TESSERA_<SERVICE>_``."""

    model_config = SettingsConfigDict(env_prefix="TESSERA_", extra="ignore", populate_by_name=True)

    nats_url: str = Field("nats://127.0.0.1:4222", validation_alias=_shared("TESSERA_NATS_URL"))
    #: The CA that signed nats-server's certificate: set, every connection is TLS and the
    #: server must prove itself (a ``tls://`` URL without it trusts the system's CAs).
    nats_ca: Path | None = Field(None, validation_alias=_shared("TESSERA_NATS_CA"))
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", validation_alias=_shared("TESSERA_REDIS_URL")
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", validation_alias=_shared("TESSERA_LOG_LEVEL")
    )
    log_format: Literal["json", "text"] = Field(
        "json", validation_alias=_shared("TESSERA_LOG_FORMAT")
    )
    otlp_endpoint: str | None = Field(None, validation_alias=_shared("TESSERA_OTLP_ENDPOINT"))
    #: Every Redis key of this cluster starts with it (``libs/contracts/keys.py``).
    key_prefix: str = Field(
        "tessera",
        pattern=r"^[A-Za-z0-9_:-]{1,64}$",
        validation_alias=_shared("TESSERA_KEY_PREFIX"),
    )
    #: Port of the service's /metrics and /healthz endpoint; 0 picks a free one, -1 turns it off.
    metrics_port: int = Field(-1, ge=-1, le=65535)
    #: Address that endpoint listens on (0.0.0.0 in a container, for Prometheus to reach it).
    metrics_host: str = Field("127.0.0.1", validation_alias=_shared("TESSERA_METRICS_HOST"))


class LauncherSettings(BaseSettings):
    """Settings of ``tessera up`` (prefix ``TESSERA_``)."""

    model_config = SettingsConfigDict(env_prefix="TESSERA_", extra="ignore")

    #: Unset: 8000, or a free port when 8000 is taken (another cluster runs).
    gateway_port: int | None = Field(None, ge=1, le=65535)
    gateway_host: str = "127.0.0.1"
    devices: int = Field(6, ge=0, le=100_000)
    workers: int = Field(2, ge=0, le=64)
    #: Unset: one when this machine has an NVIDIA GPU and the vLLM virtualenv, else none.
    vllm_workers: int | None = Field(None, ge=0, le=16)
    #: The CPU workers' engine; unset: llamacpp where `make llama` built it, else torch.
    cpu_engine: Literal["torch", "llamacpp"] | None = None
    scheduler_replicas: int = Field(1, ge=1, le=5)
    #: Unset: a free port (the run file records it).
    scheduler_http_port: int | None = Field(None, ge=1, le=65535)
    #: Where `tessera up` writes the running cluster's addresses for the other commands.
    run_file: Path = Path.home() / ".cache" / "tessera" / "cluster.json"
    #: Set only when the user points a command at a Redis of their own.
    redis_url: str | None = None
    key_prefix: str = Field("tessera", pattern=r"^[A-Za-z0-9_:-]{1,64}$")
    #: TLS on NATS: the server's certificate chain and key, and the CA that signed it (every
    #: service, and every host that joins, trusts only that CA). All three, or none.
    nats_tls_cert: Path | None = None
    nats_tls_key: Path | None = None
    nats_ca: Path | None = None

    @model_validator(mode="after")
    def _tls_whole(self) -> LauncherSettings:
        given = [self.nats_tls_cert, self.nats_tls_key, self.nats_ca]
        if any(given) and not all(given):
            raise ValueError(
                "TLS on NATS takes TESSERA_NATS_TLS_CERT, TESSERA_NATS_TLS_KEY and "
                "TESSERA_NATS_CA together"
            )
        return self


def default_home(env: Mapping[str, str] | None = None, name: str = "default") -> Path:
    """A cluster's home (``libs/cluster/home.py``): ``TESSERA_HOME``, else
    ``$XDG_DATA_HOME/tessera/<name>`` (``~/.local/share`` when unset)."""
    env = os.environ if env is None else env
    if env.get("TESSERA_HOME"):
        return Path(env["TESSERA_HOME"]).expanduser()
    data = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data).expanduser() / "tessera" / name


def model_cache_dir() -> Path:
    """Where prepared model folders live: ``TESSERA_MODEL_DIR`` or ~/.cache/tessera/models."""
    root = os.environ.get("TESSERA_MODEL_DIR")
    return Path(root) if root else Path.home() / ".cache" / "tessera" / "models"


def ready_file() -> Path | None:
    """``TESSERA_READY_FILE``: a file a service writes when it says ready (a container's
    healthcheck tests it); None when unset."""
    path = os.environ.get("TESSERA_READY_FILE")
    return Path(path) if path else None


def hub_offline() -> None:
    """Nothing may be downloaded at run time: tell Hugging Face libraries so before they load."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process: this one's, with ``extra`` set."""
    return {**os.environ, **extra}
