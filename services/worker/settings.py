"""Worker settings (prefix ``TESSERA_WORKER_``). One worker process stands in for one device."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from libs.contracts import DEFAULT_CONTEXT_TOKENS, DeviceClass
from libs.contracts.base import Precision
from libs.runtime.pki import Credentials
from libs.runtime.settings import ServiceSettings

REPO = Path(__file__).resolve().parents[2]
#: vLLM's default ``--max-num-seqs``: the most sequences it batches at once.
VLLM_MAX_SEQS = 256


class WorkerSettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="TESSERA_WORKER_", extra="ignore", populate_by_name=True
    )

    device_id: str = Field("worker-0", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    #: The class this worker emulates: its memory limit and speed factor apply.
    device_class: DeviceClass = DeviceClass.WORKSTATION
    #: The device is this host (``tessera join``): its real memory and readings, its
    #: calibrated speed; no class is emulated.
    host_device: bool = False
    seed: int = 0
    #: Overrides of the class's drawn memory (GB) and speed factor (1 = this CPU's own speed).
    memory_gb: float | None = Field(None, gt=0.0)
    speed_factor: float | None = Field(None, gt=0.0, le=1.0)
    #: The CPU quota (cores) the kernel holds this worker to (``tessera up --fleet``): its
    #: speed is calibrated here, inside it, not read from the host's cached calibration.
    cpus: float | None = Field(None, gt=0.0)
    #: The bandwidth (Mbit/s each way) ``tc`` holds this worker's link to (``--fleet``: a
    #: worker with a link of its own), announced as its network bandwidth.
    link_mbit: float | None = Field(None, gt=0.0)
    #: Report the round trip to NATS this worker measures, not its class's (on a link).
    measure_rtt: bool = False
    #: ``torch``: layer shards on the CPU in PyTorch; ``llamacpp``: layer shards in llama.cpp
    #: (its RPC backend across devices); ``vllm``: whole models in a vLLM server process.
    engine: Literal["torch", "llamacpp", "vllm"] = "torch"
    #: Telemetry period (s): each sample is the heartbeat; the failure detector waits three.
    interval_s: float = Field(1.0, ge=0.1, le=10.0)
    #: How the torch engine holds weights: int8 (weight-only, a quarter of float32's bytes and
    #: the fastest here, see docs/getting-started.md), bfloat16 or float32.
    precision: Precision = "int8"
    #: New requests a first shard accepts at once; more are refused with a clear error.
    max_active: int = Field(16, ge=1, le=10_000)
    #: A request with no traffic for this long is dropped (its END frame was lost).
    idle_s: float = Field(120.0, gt=0)
    #: Work for a shard not loaded yet waits this long before it is given up.
    park_s: float = Field(60.0, gt=0)
    #: Load the whole model at start (when it fits): work moved here after a failure starts
    #: at once instead of after a load (torch engine).
    preload: bool = False
    #: Where the prepared model folders live (default ~/.cache/tessera/models).
    model_dir: Path | None = None
    #: Where this host's calibration is cached (shared with the telemetry agent).
    cache_dir: Path = Path.home() / ".cache" / "tessera"
    #: The vLLM engine: the Python of its own virtualenv (``make vllm``) and its options.
    vllm_python: Path = REPO / ".venv-vllm" / "bin" / "python"
    vllm_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    vllm_kv_cache_gb: int = Field(1, ge=1, le=1024)
    #: CUDA graphs off (``--enforce-eager``): required by the CPU build, slower on a GPU.
    #: None: off only where vLLM runs on a GPU (``vllm_runs_eager``).
    vllm_eager: bool | None = None
    vllm_start_s: float = Field(300.0, gt=0)
    #: Tokens of context vLLM gives each request (its ``--max-model-len``).
    vllm_context: int = Field(DEFAULT_CONTEXT_TOKENS, ge=128, le=1_048_576)
    #: The llamacpp engine: its binaries (``make llama``), the address its RPC server listens
    #: on (reachable by the other devices: a joined host's own address), threads (default:
    #: every core), requests batched at once (more wait for a slot; the scheduler counts 8
    #: slots' KV cache) and each one's context where a task names none (a deployment's does).
    llama_bin: Path = REPO / ".llama"
    rpc_host: str = "127.0.0.1"
    rpc_port: int = Field(0, ge=0, le=65535)
    #: host:port announced for the RPC server in place of its own: a relay in front of it
    #: (a fleet's link, ``libs/cluster/links.py``, delays the head's RPC traffic there).
    rpc_announce: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:-]+:\d{1,5}$")
    #: The port, on ``rpc_host``, where this host lends the model files it holds to devices
    #: that need them (``libs/weights/lending.py``; 0: any free one, told in each offer).
    weights_port: int = Field(0, ge=0, le=65535)
    #: This device's cluster certificate (PEM: the CA's, its own, its key; libs/runtime/pki.py):
    #: its RPC server is lent to other hosts, and other hosts' reached, only through mutual TLS.
    rpc_ca: Path | None = None
    rpc_cert: Path | None = None
    rpc_key: Path | None = None
    llama_threads: int | None = Field(None, ge=1, le=1024)
    #: GB of received tensors this host's llama.cpp RPC server keeps for the next placement of
    #: the same model; the least recently used beyond it are removed when it starts.
    rpc_cache_gb: float = Field(20.0, ge=0.0)
    llama_slots: int = Field(8, ge=1, le=256)
    llama_context: int = Field(1024, ge=128, le=131_072)

    @property
    def rpc_credentials(self) -> Credentials | None:
        if self.rpc_ca is None or self.rpc_cert is None or self.rpc_key is None:
            return None
        return Credentials(self.rpc_ca, self.rpc_cert, self.rpc_key)

    @property
    def llama_thread_count(self) -> int:
        return self.llama_threads or os.cpu_count() or 1

    @property
    def slots(self) -> int:
        """Requests this worker's engine serves at once, as the device announces it: the torch
        ring runs a deployment's steps one at a time (1), llama.cpp its request slots, vLLM
        every request this worker accepts (``max_active``; vLLM's own cap is 256)."""
        if self.engine == "llamacpp":
            return self.llama_slots
        if self.engine == "vllm":
            return min(self.max_active, VLLM_MAX_SEQS)
        return 1

    @property
    def context_length(self) -> int | None:
        """The longest context a request gets here, as the device announces it: vLLM's
        ``--max-model-len``, fixed when it starts. None: no bound of its own (llama.cpp sizes
        its KV cache to each deployment's context, ``llama_context`` only where a task names
        none; the torch ring keeps no fixed cache)."""
        if self.engine == "vllm":
            return self.vllm_context
        return None
