"""The scheduler plans with the context each worker announces (the longest its engine gives a
request): a device whose worker gives less than a deployment's context is left out of it,
saying so, and a deployment that names no context gets one its workers can give."""

from __future__ import annotations

from typing import Any

from libs.contracts import (
    PLACEMENT_DECISION,
    PLACEMENT_REQUEST,
    SHARD_TASK,
    ModelDeployment,
    PlacementRequest,
)
from libs.runtime.memory_bus import MemoryBus
from services.scheduler.service import Scheduler
from tests.builders import NOW
from tests.unit.services.test_scheduler_handlers import MODEL
from tests.unit.services.test_scheduler_handlers import start as start_scheduler


async def start(contexts: dict[str, int | None]) -> tuple[Scheduler, MemoryBus]:
    """A scheduler over torch workstations (1 GB, the first the fastest) whose workers
    announce the longest context in ``contexts`` (None: no bound of their own)."""
    devices = {device_id: (1.0, 4.0 - rank) for rank, device_id in enumerate(contexts)}
    return await start_scheduler(devices, contexts=contexts)


async def deploy(bus: MemoryBus, context: int | None, **told: Any) -> Any:
    task = ModelDeployment(deployment_id="smol", model=MODEL, context_length=context, **told)
    request = PlacementRequest(task=task, ts=NOW)
    return await bus.request(PLACEMENT_REQUEST, request, PLACEMENT_DECISION, timeout_s=10)


async def test_a_device_whose_worker_gives_a_shorter_context_is_left_out_saying_so() -> None:
    """ws-a, the fastest, gives 1,024 tokens: a 2,048-token deployment goes elsewhere, one
    told to use ws-a is refused naming its context, and with every worker that short the
    deployment is refused saying why. At 1,024 tokens ws-a takes it."""
    cases: list[tuple[dict[str, int | None], dict[str, Any], int, bool]] = [
        ({"ws-a": 1024, "ws-b": None, "ws-c": 4096}, {}, 2048, True),
        ({"ws-a": 1024, "ws-b": None}, {"devices": ("ws-a",)}, 2048, False),
        ({"ws-a": 1024, "ws-b": 1024}, {}, 2048, False),
        ({"ws-a": 1024, "ws-b": 1024}, {"devices": ("ws-a",)}, 1024, True),
    ]
    for contexts, told, context, placed in cases:
        service, bus = await start(contexts)
        try:
            decision = await deploy(bus, context, **told)
            assert decision.placed == placed, (contexts, told, decision.reason)
            if placed:
                fits = {d for d, c in contexts.items() if c is None or c >= context}
                assert {a.device_id for a in decision.assignments} <= fits, decision.assignments
                assert service.book.by_id["smol"].context_length == context
            else:
                assert decision.reason is not None
                assert "ws-a (its worker gives a request at most 1,024 tokens" in decision.reason
                assert "the deployment 2,048" in decision.reason
        finally:
            await service.abandon()
            await bus.close()


async def test_a_deployment_naming_no_context_gets_one_its_workers_give() -> None:
    """No context named: 2,048 tokens (SmolLM2 was trained on more), lowered to the longest
    context its workers give when every one gives less (1,536 here: ws-b's; ws-a, at 1,024,
    is left out); a worker with no bound of its own (None) keeps 2,048. Each shard task
    carries the deployment's context (llama.cpp sizes its KV cache with it)."""
    for contexts, expected, used in (
        ({"ws-a": 1024, "ws-b": 1536}, 1536, {"ws-b"}),
        ({"ws-a": 1024, "ws-b": None}, 2048, {"ws-b"}),
        ({"ws-a": None, "ws-b": 8192}, 2048, None),
    ):
        service, bus = await start(contexts)
        try:
            decision = await deploy(bus, None)
            assert decision.placed, decision.reason
            assert service.book.by_id["smol"].context_length == expected
            await bus.settle()
            loads = [t for t in bus.sent(SHARD_TASK) if t.action == "load"]
            assert loads and all(t.context_length == expected for t in loads)
            if used is not None:
                assert {a.device_id for a in decision.assignments} <= used
        finally:
            await service.abandon()
            await bus.close()
