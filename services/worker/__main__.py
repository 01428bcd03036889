"""Run one worker: ``python -m services.worker`` (settings: ``TESSERA_WORKER_*``)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from libs.devices.calibration import Calibration, cached, measure
from libs.devices.cgroup_memory import memory_room_gb
from libs.devices.emulated import EmulatedDevice
from libs.devices.gpu_device import GpuDevice
from libs.devices.host_device import HostDevice, open_nvml
from libs.models.engine_support import is_vllm_cpu_build, vllm_build
from libs.models.shipped import prepare
from libs.runtime.bus import Bus, NatsBus
from libs.runtime.lifecycle import Background, announce_ready, run_service
from libs.runtime.logs import configure_logging
from libs.runtime.metrics import serve_metrics
from libs.runtime.nats_client import close_nats, connect_nats
from libs.runtime.tracing import configure_tracing
from libs.weights.lending import Lender, lends
from services.worker.device.metrics import WorkerMetrics
from services.worker.device.worker import DeviceWorker
from services.worker.rpc.server import RpcServer
from services.worker.served.llama_worker import LlamaWorker
from services.worker.served.llama_worker import server_factory as llama_servers
from services.worker.served.llama_worker import vram_gb as llama_vram_gb
from services.worker.settings import WorkerSettings

log = logging.getLogger("services.worker")


def make_device(
    settings: WorkerSettings, now: float, host: Calibration | None = None, nvml: Any = None
) -> EmulatedDevice:
    """The device this worker stands in for: memory, power and heat drawn from its class
    (with the overrides applied). A CPU worker's speed is what this ``host`` measures times the
    speed factor it runs at, so that what it announces is what its work measures; without a
    calibration the class's figures stand. A vLLM worker of vLLM's GPU build whose host's NVML
    (``nvml``, else opened here) reads a GPU is that GPU (``GpuDevice``: its own readings,
    class cloud_gpu)."""
    if settings.host_device:
        calibration = host or cached(settings.cache_dir)
        real = HostDevice.probe(settings.device_id, calibration, settings.memory_gb)
        return dataclasses.replace(
            real,
            engines=(settings.engine,),
            slots=settings.slots,
            context_length=settings.context_length,
        )
    rng = np.random.default_rng(settings.seed)
    gpu_build = not is_vllm_cpu_build(vllm_build(settings.vllm_python.parent.parent))
    if settings.engine == "vllm" and gpu_build:  # where NVML reads a GPU, the device is it
        gpu = GpuDevice.probe(settings.device_id, open_nvml() if nvml is None else nvml, rng, now)
        if gpu is not None:
            gpu.engines, gpu.slots = (settings.engine,), settings.slots
            gpu.context_length = settings.context_length
            return gpu
    device = EmulatedDevice.draw(settings.device_id, settings.device_class, rng, now)
    # Held to a CPU quota, its calibration is its speed: no factor on top.
    speed = 1.0 if settings.cpus else settings.speed_factor or min(1.0, device.speed_factor)
    update: dict[str, float] = {}
    if host is not None:
        update["fp32_tflops"] = host.fp32_gflops / 1000.0 * speed
        update["int8_tops"] = host.int8_gops / 1000.0 * speed
        update["memory_bandwidth_gbps"] = host.memory_bandwidth_gbps * speed
    if settings.memory_gb is not None:
        update["memory_total_gb"] = settings.memory_gb
    if settings.link_mbit is not None:
        update["network_bandwidth_mbps"] = settings.link_mbit
    caps = device.capabilities.model_copy(update=update)
    sources = dict(device.sources)
    if host is not None:  # the host's measured speed, as is (held to a quota) or by its class
        sources["speed"] = "measured" if settings.cpus else "estimated"
    if settings.cpus and settings.memory_gb is not None:  # its cgroup's limit
        sources["memory"] = "enforced"
    if settings.measure_rtt:  # its round trip measured, over a link tc holds to its bandwidth
        sources["network"] = "measured"
    return dataclasses.replace(
        device,
        sources=sources,
        capabilities=caps,
        speed_factor=speed,
        engines=(settings.engine,),
        slots=settings.slots,
        context_length=settings.context_length,
    )


def make_worker(
    bus: Bus,
    device: EmulatedDevice,
    folder: Path,
    settings: WorkerSettings,
    metrics: WorkerMetrics,
    compute: ThreadPoolExecutor | None = None,
) -> DeviceWorker:
    """The worker of the configured engine (each imports only what it needs)."""
    if settings.engine == "vllm":
        from services.worker.served.vllm_worker import VllmWorker, server_factory, vllm_runs_eager

        make_server = server_factory(
            settings.vllm_python,
            folder,
            dtype=settings.vllm_dtype,
            kv_cache_gb=settings.vllm_kv_cache_gb,
            eager=vllm_runs_eager(settings.vllm_eager, settings.vllm_python),
            context=settings.vllm_context,
            # The GPU's memory, where the device is the GPU: each server takes its share.
            gpu_gb=device.capabilities.memory_total_gb if isinstance(device, GpuDevice) else None,
        )
        return VllmWorker(
            bus,
            device,
            make_server,
            max_active=settings.max_active,
            park_s=settings.park_s,
            start_s=settings.vllm_start_s,
            metrics=metrics,
            venv=settings.vllm_python.parent.parent,
        )
    if settings.engine == "llamacpp":
        threads = settings.llama_thread_count
        device.vram_gb = llama_vram_gb(settings)  # None: serves from host memory only
        rpc = RpcServer(
            settings.llama_bin,
            settings.rpc_host,
            settings.rpc_port,
            threads,
            settings.rpc_credentials,
            int(settings.rpc_cache_gb * 10**9),
            settings.rpc_announce,
            gpu=device.vram_gb is not None,
        )
        return LlamaWorker(
            bus,
            device,
            llama_servers(settings),
            rpc,
            measured_file=settings.cache_dir
            / "measured"
            / f"{settings.device_id}-llamacpp-{threads}t.json",
            max_active=settings.max_active,
            park_s=settings.park_s,
            metrics=metrics,
        )
    # torch and transformers (~2.5 s to import) only for the engine that runs them: a llama.cpp
    # worker started again by its supervisor is back that much sooner.
    from services.worker.torch.worker import TorchWorker

    return TorchWorker(
        bus,
        device,
        folder,
        precision=settings.precision,
        max_active=settings.max_active,
        park_s=settings.park_s,
        metrics=metrics,
        compute=compute,
    )


async def main(stop: asyncio.Event, settings: WorkerSettings) -> None:
    from libs.agents.emulated_fleet import FleetAgent

    configure_tracing("worker", settings.otlp_endpoint)
    metrics = WorkerMetrics()
    serve_metrics(metrics.registry, settings.metrics_port, settings.metrics_host)
    # One thread runs every torch call of this process (services/worker/torch/held.py).
    torch_thread = ThreadPoolExecutor(1, thread_name_prefix="torch")
    loop = asyncio.get_running_loop()
    folder = await loop.run_in_executor(torch_thread, lambda: prepare(cache_dir=settings.model_dir))
    host = None
    if settings.engine != "vllm":  # under a CPU quota: measured inside it, over whole periods
        measured = partial(measure, sustained_s=1.0) if settings.cpus else None
        calibrate = measured or partial(cached, settings.cache_dir)
        host = await loop.run_in_executor(torch_thread, calibrate)
    device = make_device(settings, time.time(), host)
    if settings.cpus and (room := memory_room_gb()) is not None:  # held: what its limit leaves
        limit_gb, used_gb = room
        device.memory_available_gb = max(0.0, limit_gb - used_gb)
        log.info("memory limit", extra={"limit_gb": limit_gb, "used_gb": used_gb})
    nc = await connect_nats(
        settings.nats_url, f"worker-{settings.device_id}", ca_file=settings.nats_ca
    )
    # The scheduler creates the streams (a device may not): the consumer waits for them.
    bus = NatsBus(nc)
    worker = make_worker(bus, device, folder, settings, metrics, torch_thread)
    await worker.start()
    # Model files this host holds, lent to devices that need them (libs/weights/lending.py),
    # where the cluster's NATS is not encrypted (a lent file is not).
    lender = Lender(nc, device.device_id, settings.rpc_host, settings.weights_port)
    if lends(nc):
        await lender.start()
    if settings.preload:
        await worker.preload()
    # The worker alone assigns its device's work, once a shard really loaded: the agent
    # only reports what the device does.
    agent = FleetAgent(
        bus,
        [device],
        settings.interval_s,
        seed=settings.seed,
        follow_work=False,
        measure_rtt=settings.measure_rtt,
    )
    telemetry = asyncio.create_task(agent.run(stop))
    background = Background("worker")

    async def expire() -> None:
        await worker.expire(settings.idle_s)

    background.every(5.0, expire)
    background.every(settings.interval_s, worker.tick)
    await nc.flush()  # the server holds our subscriptions before we say ready
    announce_ready(
        "worker",
        device_id=device.device_id,
        device_class=str(device.device_class),
        engine=settings.engine,
        speed_factor=device.speed_factor,
    )
    await stop.wait()
    if settings.host_device:  # a joined host leaves: its shards move before it goes
        await worker.leave(connected=lambda: nc.is_connected)
    await background.close()
    await telemetry
    await worker.close()
    await lender.close()
    await close_nats(nc)


if __name__ == "__main__":
    settings = WorkerSettings()
    configure_logging(f"worker-{settings.device_id}", settings.log_level, settings.log_format)
    sys.exit(run_service("worker", lambda stop: main(stop, settings)))
