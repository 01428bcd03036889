"""The scheduler applies a score update as the scorer sent it: the update carries the row the
scorer wrote (scores, the sample scored, the speed scale), so the scheduler's view reads Redis
only at start and for a device it holds no announce for (or an older one)."""

from __future__ import annotations

from typing import Any

from libs.contracts import SCORE, TELEMETRY, DeviceClass, Mode, ScoreUpdate
from libs.core.model import speed_gflops
from services.scheduler.view import row_of
from tests.builders import NOW, make_telemetry
from tests.unit.services.test_scheduler_handlers import start
from tests.unit.services.test_scorer_handlers import announce, row, scorer

__all__ = ["scorer"]  # the scorer's fixture, used below


class NoRedis:
    """A Redis that fails on any use: the view must not touch it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the view used Redis ({name})")


def update(device_id: str, total: float, **sample: Any) -> ScoreUpdate:
    return ScoreUpdate(
        device_id=device_id,
        device_class=DeviceClass.WORKSTATION,
        ts=NOW + 5,
        mode=Mode.BALANCED,
        compute=0.9,
        memory=0.8,
        efficiency=0.7,
        network=0.6,
        stability=0.95,
        total=total,
        sample=make_telemetry(
            device_id, **{"memory_total_gb": 1.0, "memory_available_gb": 0.5} | sample
        ),
        speed_scale=0.5,
        announced_ts=NOW,
    )


async def test_a_score_update_is_applied_as_sent_without_reading_redis() -> None:
    service, bus = await start({"ws-a": (1.0, 4.0), "ws-b": (1.0, 2.0)})
    try:
        service.view.redis = NoRedis()  # type: ignore[assignment]
        sent = update("ws-a", 0.83, memory_available_gb=0.25, temperature_c=61.0)
        await bus.publish(SCORE, sent, device_id="ws-a")
        await bus.settle()
        await service.tick()
        assert service.view.rows["ws-a"] == row_of(sent)
        [device] = service.view.devices({}, {}, only={"ws-a"})
        assert device.capability == (0.9, 0.8, 0.7, 0.6, 0.95)
        assert device.memory_free_gb == 0.25 and device.temperature_c == 61.0
        assert device.speed == speed_gflops(4.0, 0.5)
        assert service.view.rows["ws-b"].total == 0.5  # the other device as loaded
    finally:
        await service.abandon()
        await bus.close()


async def test_a_device_the_view_has_no_announce_for_is_read_from_redis() -> None:
    """An update for a device that joined after the view loaded (or announced again since)
    is read from Redis at the next tick, announce and row together."""
    service, bus = await start({"ws-a": (1.0, 4.0)})
    try:
        await bus.publish(SCORE, update("ws-new", 0.7), device_id="ws-new")
        newer = update("ws-a", 0.6).model_copy(update={"announced_ts": NOW + 1})
        await bus.publish(SCORE, newer, device_id="ws-a")
        await bus.settle()
        assert service.to_refresh == {"ws-new", "ws-a"}
        assert service.view.received == {}
    finally:
        await service.abandon()
        await bus.close()


async def test_the_row_applied_from_an_update_is_the_row_the_scorer_wrote(scorer: Any) -> None:
    scoring, bus, redis, _ = scorer
    await announce(bus, "phone-1", DeviceClass.PHONE)
    await bus.publish(TELEMETRY, make_telemetry("phone-1"), device_id="phone-1")
    await bus.settle()
    await scoring.flush()
    await bus.settle()
    [sent] = bus.sent(SCORE)
    assert row_of(sent) == await row(redis, "phone-1")
    assert sent.announced_ts == NOW
