"""The scheduler's mode and policy, and the DVFS hints of the mode's power policy. The mode
is evaluated from the cluster's rates per unit of demand (``libs/core/modes.py``), switched by
hand or automatically, announced to the scorer (``MODE_CHANGE``) and kept in Redis for a
scorer that starts later. ``Scheduler`` (service.py) is a ``ModeKeeping``; these run as its
commands (``loop.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from redis.asyncio import Redis

from libs.contracts import DVFS_HINT, MODE_CHANGE, DvfsHint, Mode, ModeChange
from libs.contracts.keys import Keys
from libs.contracts.profiles import DimensionWeights, Profile
from libs.core.energy import dvfs_hint
from libs.core.fleet_state import FleetState
from libs.core.modes import ModeSwitcher, cluster_busy
from libs.core.policies import make_policy
from libs.core.policy import Policy
from libs.core.profiles import BUILTIN_PROFILES
from libs.runtime.bus import Bus
from services.scheduler.loop import CommandLoop
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.state import SchedulerState
from services.scheduler.view import ClusterView, Read

log = logging.getLogger("services.scheduler.service")  # its records, as before the move


class ModeKeeping:
    """What the mode needs of the scheduler, set by ``Scheduler.__init__``."""

    bus: Bus
    redis: Redis
    keys: Keys
    metrics: SchedulerMetrics
    clock: Callable[[], float]
    view: ClusterView
    state: SchedulerState
    switcher: ModeSwitcher
    policy: Policy
    loop: CommandLoop
    hints: dict[str, tuple[float, float]]

    async def evaluate_mode_soon(self) -> None:
        """Every ``mode_eval_s``: read the live devices (outside the loop), then evaluate the
        mode as a command."""
        read = await self.view.read(sorted(set(self.view.rows) - self.view.failed))
        await self.loop.call(lambda: self.evaluate_mode(read), "mode")

    async def evaluate_mode(self, read: Read | None = None) -> None:
        """Feed the mode switcher the cluster's rates and the demand they were measured under
        (the requests the live devices report), so that less demand is not read as less
        performance (``libs/core/modes.py``). ``read``: the live devices as just read (None:
        read them now)."""
        if read is None:
            read = await self.view.read(sorted(set(self.view.rows) - self.view.failed))
        self.view.apply(read)
        throughput, efficiency = self.view.cluster_rates()
        live = self.view.rows.keys() - self.view.failed
        busy = cluster_busy(r.sample for d, r in self.view.rows.items() if d in live and r.sample)
        self.metrics.cluster_tokens_per_second.set(throughput)
        self.metrics.cluster_tokens_per_joule.set(efficiency)
        change = self.switcher.observe(self.clock(), throughput, efficiency, busy)
        if change is not None:
            await self.set_mode(change.mode, change.reason, manual=False)

    async def set_mode(self, mode: Mode | None, reason: str, manual: bool) -> None:
        """Switch mode (``None`` with ``manual``: back to automatic switching)."""
        now = self.clock()
        previous = self.state.mode
        if manual:
            self.switcher.override(mode, now)
            self.state.manual_mode = mode is not None
            if mode is None:
                return
        assert mode is not None
        self.state.mode, self.state.profile = mode, BUILTIN_PROFILES[mode]
        self.policy = make_policy(self.state.policy, self.state.profile)
        self.state.counters["mode_changes"] += 1
        await self._store_mode()
        change = ModeChange(mode=mode, previous=previous, manual=manual, reason=reason, ts=now)
        await self.bus.publish(MODE_CHANGE, change)
        self._show_mode()
        log.warning(
            "mode changed",
            extra={
                "mode": mode.value,
                "previous": previous.value,
                "reason": reason,
                "manual": manual,
            },
        )

    async def set_policy(self, name: str, profile: Profile | None) -> None:
        """Raises ``KeyError`` for an unknown policy or plugin. A profile's dimension weights
        reach the scorer too, so the scores the policy reads are weighted as it says."""
        new = make_policy(name, profile or self.state.profile)
        self.policy, self.state.policy = new, name
        if profile is not None:
            self.state.profile = profile
            await self._store_mode()
            change = ModeChange(
                mode=self.state.mode,
                previous=self.state.mode,
                manual=True,
                reason=f"profile {profile.name} set",
                ts=self.clock(),
                weights=self._custom_weights(),
            )
            await self.bus.publish(MODE_CHANGE, change)
        self._show_mode()

    def _custom_weights(self) -> DimensionWeights | None:
        """The active profile's dimension weights where they differ from the mode's own."""
        weights = self.state.profile.dimensions
        return None if weights == BUILTIN_PROFILES[self.state.mode].dimensions else weights

    async def _store_mode(self) -> None:
        """The mode and the scorer's weights in Redis, for a scorer that starts later."""
        weights = self._custom_weights()
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.mode, self.state.mode.value)
        if weights is None:
            pipe.delete(self.keys.weights)
        else:
            pipe.set(self.keys.weights, weights.model_dump_json())
        await pipe.execute()

    def _show_mode(self) -> None:
        for mode in Mode:
            self.metrics.mode.labels(mode.value).set(1.0 if mode == self.state.mode else 0.0)
        for name, value in self.state.checkpoint(self.clock()).weights.items():
            self.metrics.weights.labels(name).set(value)

    async def _send_hints(self, fleet: FleetState, now: float) -> None:
        """DVFS hints to devices whose hint changed: slow when idle or hot, fast when busy.
        ``fleet`` is this cycle's, so the load includes what the cycle just placed."""
        urgent = {
            a.device_id
            for a in self.state.active.values()
            if getattr(a.request.task, "urgency", 0.0) >= 0.8
        }
        sleep_after_s = self.state.profile.sleep_after_s  # the mode's power policy
        for i, device_id in enumerate(fleet.ids):
            if not fleet.alive[i]:
                continue
            hint = dvfs_hint(
                float(fleet.load[i]),
                device_id in urgent,
                float(fleet.temperature_c[i]),
                float(fleet.thermal_limit_c[i]),
            )
            if self.hints.get(device_id) == (hint.frequency_scale, sleep_after_s):
                continue
            self.hints[device_id] = (hint.frequency_scale, sleep_after_s)
            message = DvfsHint(
                device_id=device_id,
                ts=now,
                frequency_scale=hint.frequency_scale,
                reason=hint.reason,
                sleep_after_s=sleep_after_s,
            )
            await self.bus.publish(DVFS_HINT, message, device_id=device_id)
