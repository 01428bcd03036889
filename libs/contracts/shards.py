"""Shard messages: the scheduler's order to a worker to load or drop one shard of a deployment
(``ShardTask``, built per pipeline by ``shard_ring``), the worker's answer (``ShardStatus``) and
a device's progress receiving the model's weights (``WeightsProgress``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import Field, model_validator

from libs.contracts.base import (
    DeploymentId,
    DeviceId,
    Endpoint,
    Fraction,
    ModelName,
    Precision,
    Timestamp,
    WireModel,
)
from libs.contracts.models import ModelCard


class ShardTask(WireModel):
    """Tells a worker to load (or drop) one shard of a deployment. ``epoch`` grows on migration."""

    action: Literal["load", "unload"]
    deployment_id: DeploymentId
    model: ModelName
    device_id: DeviceId
    shard_index: Annotated[int, Field(ge=0)]
    shard_count: Annotated[int, Field(ge=1)]
    layer_start: Annotated[int, Field(ge=0)]
    layer_end: Annotated[int, Field(ge=1)]
    next_device_id: DeviceId | None = None
    #: Every device of the pipeline in order: the last shard sends tokens back to the first.
    route: tuple[DeviceId, ...] = Field(default=(), max_length=256)
    epoch: Annotated[int, Field(ge=0)]
    ts: Timestamp
    #: The deployment's precision (None: the worker's own, ``TESSERA_WORKER_PRECISION``).
    precision: Precision | None = None
    #: Every shard's layers (start, end), in route order (an engine that runs the whole
    #: pipeline from its first shard, llama.cpp's, needs them all).
    spans: tuple[tuple[int, int], ...] = Field(default=(), max_length=256)
    #: Every device's llama.cpp RPC address (host:port), in route order; empty unless every
    #: device of the route announced one.
    endpoints: tuple[Endpoint, ...] = Field(default=(), max_length=256)
    #: The deployment's context length, tokens (None: the worker's own; llama.cpp's server
    #: gives each request slot this much KV cache, as the placement counted).
    context_length: Annotated[int, Field(ge=1, le=1_048_576)] | None = None
    #: The model's card (its file, architecture and sizes), on a load: a worker serves a
    #: registered model from it (None: a task built outside a deployment, or an unload).
    card: ModelCard | None = None
    #: Of this shard's layers, how many the placement put in the device's GPU memory (a device
    #: that announced ``vram_gb``): its last ones, as llama.cpp offloads them; the last
    #: shard's output layer counts as one more. 0: none, the shard serves from host memory.
    gpu_layers: Annotated[int, Field(ge=0, le=100_000)] = 0
    #: Every shard's ``gpu_layers`` in route order, None for a device whose engine has no GPU
    #: (its RPC server serves from the CPU alone); empty where no device of the route has one.
    #: A split's head names each RPC server's devices by it (one with a GPU lends two).
    gpu_spans: tuple[Annotated[int, Field(ge=0, le=100_000)] | None, ...] = Field(
        default=(), max_length=256
    )
    #: The memory (GB) the placement counted for this shard on its device (0: not said): a
    #: vLLM server on a GPU takes that share of the GPU's memory (``--gpu-memory-utilization``).
    memory_gb: Annotated[float, Field(ge=0.0, le=65536.0)] = 0.0

    @model_validator(mode="after")
    def _shape(self) -> ShardTask:
        if self.layer_end <= self.layer_start:
            raise ValueError("layer_end must be above layer_start")
        if self.shard_index >= self.shard_count:
            raise ValueError("shard_index must be below shard_count")
        if self.route and (
            len(self.route) != self.shard_count or self.route[self.shard_index] != self.device_id
        ):
            raise ValueError("route must list shard_count devices with this one at shard_index")
        for name in ("spans", "endpoints", "gpu_spans"):
            if getattr(self, name) and len(getattr(self, name)) != self.shard_count:
                raise ValueError(f"{name} must list shard_count entries")
        if self.spans and self.spans[self.shard_index] != (self.layer_start, self.layer_end):
            raise ValueError("spans must hold this shard's layers at shard_index")
        if self.gpu_spans and (self.gpu_spans[self.shard_index] or 0) != self.gpu_layers:
            raise ValueError("gpu_spans must hold this shard's gpu_layers at shard_index")
        return self


def shard_ring(
    action: Literal["load", "unload"],
    deployment_id: str,
    model: str,
    shards: Sequence[tuple[str, int, int]],
    epoch: int,
    ts: float,
    precision: Precision | None = None,
    endpoints: Sequence[str] = (),
    context_length: int | None = None,
    card: ModelCard | None = None,
    gpu: Sequence[int | None] = (),
    memory_gb: Sequence[float] = (),
) -> list[ShardTask]:
    """One task per shard of a pipeline: ``shards`` lists (device, layer_start, layer_end) in
    order; each shard learns the next device, the whole route (the last one sends tokens back
    to the first), every shard's layers and, where given, every device's RPC address; the
    ``gpu``: each shard's layers the placement put in its device's GPU memory (None: a device
    with no GPU), and ``memory_gb``: the memory it counted each (in route order, where given)."""
    route = tuple(device for device, _, _ in shards)
    spans = tuple((start, end) for _, start, end in shards)
    loading = action == "load"
    gpu_spans = tuple(gpu) if loading and any(g is not None for g in gpu) else ()
    return [
        ShardTask(
            action=action,
            deployment_id=deployment_id,
            model=model,
            device_id=device,
            shard_index=i,
            shard_count=len(route),
            layer_start=start,
            layer_end=end,
            next_device_id=route[i + 1] if i + 1 < len(route) else None,
            route=route,
            epoch=epoch,
            ts=ts,
            precision=precision,
            spans=spans,
            endpoints=tuple(endpoints),
            context_length=context_length,
            card=card if action == "load" else None,
            gpu_layers=(gpu_spans[i] or 0) if gpu_spans else 0,
            gpu_spans=gpu_spans,
            memory_gb=memory_gb[i] if memory_gb and loading else 0.0,
        )
        for i, (device, start, end) in enumerate(shards)
    ]


ShardState = Literal["loading", "loaded", "refused", "unloaded", "failed"]


class ShardStatus(WireModel):
    """A worker's answer to a ``ShardTask``: the shard is loading (with ``progress``, sent as
    it goes), loaded, refused (it cannot serve it: ``reason`` says why, re-placing elsewhere
    may help), unloaded or failed (it tried and broke: ``reason``)."""

    deployment_id: DeploymentId
    device_id: DeviceId
    shard_index: Annotated[int, Field(ge=0)]
    epoch: Annotated[int, Field(ge=0)]
    state: ShardState
    engine: Annotated[str, Field(max_length=32)] = "torch"
    reason: Annotated[str, Field(max_length=2000)] | None = None
    #: Share of the shard loaded so far (``loading``); 1.0 once ``loaded``.
    progress: Fraction | None = None
    load_s: Annotated[float, Field(ge=0.0)] = 0.0
    ts: Timestamp


class WeightsProgress(WireModel):
    """A device's share of a model's weights on its way to it (``WEIGHTS_PROGRESS``): bytes
    received of the bytes it needs (its whole file, or its layer range's chunks), sent as they
    arrive (every ~5 % or second) and once at the end. The dashboard draws it per device."""

    device_id: DeviceId
    model: ModelName
    deployment_id: DeploymentId
    shard_index: Annotated[int, Field(ge=0)]
    bytes_done: Annotated[int, Field(ge=0, le=1 << 50)]
    bytes_total: Annotated[int, Field(ge=0, le=1 << 50)]
    ts: Timestamp

    @model_validator(mode="after")
    def _within(self) -> WeightsProgress:
        if self.bytes_done > self.bytes_total:
            raise ValueError("bytes_done is more than bytes_total")
        return self
