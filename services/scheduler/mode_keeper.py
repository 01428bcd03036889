"""The scheduler's mode and policy, and the DVFS hints of the mode's power policy.

The mode is evaluated from the cluster's rates per unit of demand (``libs/core/modes.py``),
switched by hand or automatically, announced to the scorer (``MODE_CHANGE``) and kept in Redis
for a scorer that starts later. ``ModeKeeper`` owns the mode, the manual flag, the policy and
its profile, and the hints it sent; the scheduler calls it from its command loop (``loop.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

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
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.view import ClusterView, Read

log = logging.getLogger("services.scheduler.service")  # its records, as before the move


class ModeKeeper:
    def __init__(
        self,
        mode: Mode,
        policy: str,
        dwell_s: float,
        *,
        bus: Bus,
        redis: Redis,
        keys: Keys,
        metrics: SchedulerMetrics,
        view: ClusterView,
        clock: Callable[[], float],
    ) -> None:
        self.bus, self.redis, self.keys, self.metrics = bus, redis, keys, metrics
        self.view, self.clock = view, clock
        self.mode, self.manual, self.policy_name = mode, False, policy
        self.profile: Profile = BUILTIN_PROFILES[mode]
        self.switcher = ModeSwitcher(mode=mode, dwell_s=dwell_s)
        self.policy: Policy = make_policy(policy, self.profile)
        #: Mode changes so far (a counter of the checkpoint).
        self.changes = 0
        #: (clock share, sleep after) last sent to each device.
        self.hints: dict[str, tuple[float, float]] = {}

    def restore(self, mode: Mode, policy: str) -> None:
        """The mode and policy a checkpoint holds, with the mode's built-in profile (a custom
        profile set at run time is configuration, set again by its owner)."""
        self.mode, self.policy_name, self.profile = mode, policy, BUILTIN_PROFILES[mode]
        self.switcher.mode = mode
        self.policy = make_policy(policy, self.profile)

    def weights(self) -> dict[str, float]:
        """The active profile's weights, flat (the checkpoint's and the metrics' form)."""
        profile = self.profile
        weights = {f"score.{k}": v for k, v in profile.scores.items()}
        weights |= {f"dimension.{k}": v for k, v in profile.dimensions.model_dump().items()}
        return weights | {"urgency": profile.urgency, "complexity": profile.complexity}

    async def evaluate(self, read: Read | None = None) -> None:
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
        previous = self.mode
        if manual:
            self.switcher.override(mode, now)
            self.manual = mode is not None
            if mode is None:
                return
        assert mode is not None
        self.mode, self.profile = mode, BUILTIN_PROFILES[mode]
        self.policy = make_policy(self.policy_name, self.profile)
        self.changes += 1
        await self.store()
        change = ModeChange(mode=mode, previous=previous, manual=manual, reason=reason, ts=now)
        await self.bus.publish(MODE_CHANGE, change)
        self.show()
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
        new = make_policy(name, profile or self.profile)
        self.policy, self.policy_name = new, name
        if profile is not None:
            self.profile = profile
            await self.store()
            change = ModeChange(
                mode=self.mode,
                previous=self.mode,
                manual=True,
                reason=f"profile {profile.name} set",
                ts=self.clock(),
                weights=self._custom_weights(),
            )
            await self.bus.publish(MODE_CHANGE, change)
        self.show()

    def _custom_weights(self) -> DimensionWeights | None:
        """The active profile's dimension weights where they differ from the mode's own."""
        weights = self.profile.dimensions
        return None if weights == BUILTIN_PROFILES[self.mode].dimensions else weights

    async def store(self) -> None:
        """The mode and the scorer's weights in Redis, for a scorer that starts later."""
        weights = self._custom_weights()
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.mode, self.mode.value)
        if weights is None:
            pipe.delete(self.keys.weights)
        else:
            pipe.set(self.keys.weights, weights.model_dump_json())
        await pipe.execute()

    def show(self) -> None:
        """The mode and the weights as metrics."""
        for mode in Mode:
            self.metrics.mode.labels(mode.value).set(1.0 if mode == self.mode else 0.0)
        for name, value in self.weights().items():
            self.metrics.weights.labels(name).set(value)

    async def send_hints(self, fleet: FleetState, urgent: Collection[str], now: float) -> None:
        """DVFS hints to devices whose hint changed: slow when idle or hot, fast when busy
        (``urgent``: devices running urgent work). ``fleet`` is this cycle's, so the load
        includes what the cycle just placed."""
        sleep_after_s = self.profile.sleep_after_s  # the mode's power policy
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
