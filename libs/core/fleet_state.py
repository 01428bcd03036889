"""The fleet as arrays, one entry per device, for vectorised filtering and scoring.

A ``FleetState`` is built from a snapshot of ``Device`` values at the start of a decision
cycle and updated in place, one device at a time, as the cycle assigns tasks, so that later
tasks of the same cycle see the load, memory, power and heat the earlier ones added.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from libs.contracts import DeviceClass
from libs.core import energy
from libs.core.blocks import BLOCK_SIZE, MIN_BLOCKS, FleetBlocks
from libs.core.model import Device, Task

F64 = npt.NDArray[np.float64]
Bool = npt.NDArray[np.bool_]
#: Which devices a per-device function covers: all (``slice(None)``), one, or an index array.
At = slice | int | npt.NDArray[np.intp]


def lowest(costs: F64, alive: Bool) -> float:
    """The least of ``costs`` among live devices (all, when none is alive; 0 for no device)."""
    usable = costs[alive] if alive.any() else costs
    return float(usable.min()) if len(usable) else 0.0


def service_seconds(task: Task, speed: F64, prefill: F64, decode: F64) -> F64:
    """``task``'s own seconds on devices of these rates (``FleetState.service_s``), arrays of
    any shape."""
    by_work = task.work / speed
    if task.output_tokens <= 0:
        return np.asarray(by_work)
    known = (prefill > 0) & (decode > 0)
    with np.errstate(divide="ignore", invalid="ignore"):  # unknown rates: by_work instead
        by_tokens = task.prompt_tokens / prefill + task.output_tokens / decode
    return np.asarray(np.where(known, by_tokens, by_work))


def wait_by_load(load: float, slots: float, speed: float) -> float:
    """The wait for a slot when a device does not report it: the tasks beyond its slots, each
    a unit of work at its speed, shared by its slots."""
    beyond = max(0.0, load * slots - slots + 1.0)
    return beyond / speed / slots


class FleetState:
    """Struct of arrays over devices. Index ``i`` is ``ids[i]``.

    A fleet of ``MIN_BLOCKS`` blocks or more is also grouped into ``blocks`` (fastest
    first) with bounds on each block's expected completion, so that ``earliest_s`` and the
    pipeline's search visit only the blocks that can hold the answer; ``block_size=None``
    scores every device (the reference the block search is tested against).
    """

    def __init__(self, devices: Sequence[Device], block_size: int | None = BLOCK_SIZE) -> None:
        self.devices = list(devices)
        self.ids = [d.device_id for d in devices]
        self.index = {device_id: i for i, device_id in enumerate(self.ids)}
        if len(self.index) != len(self.ids):
            raise ValueError("device ids must be unique")
        self.classes = [d.device_class for d in devices]

        def arr(values: Sequence[float]) -> F64:
            return np.asarray(values, dtype=np.float64)

        self.capability = np.asarray([d.capability for d in devices], dtype=np.float64).reshape(
            len(devices), 5
        )
        norms = np.linalg.norm(self.capability, axis=1)
        #: Rows scaled to unit length (all-zero rows stay zero): cosine needs one dot product.
        self.capability_unit = self.capability / np.where(norms > 0, norms, 1.0)[:, None]
        #: The same, one row per dimension: a dimension's values over the fleet are contiguous.
        self.capability_unit_t = np.ascontiguousarray(self.capability_unit.T)
        self.memory_total_gb = arr([d.memory_total_gb for d in devices])
        self.memory_free_gb = arr([d.memory_free_gb for d in devices])
        self.power_max_w = arr([d.power_max_w for d in devices])
        self.power_now_w = arr([d.power_now_w for d in devices])
        self.power_idle_w = arr([d.power_idle_w for d in devices])
        self.temperature_c = arr([d.temperature_c for d in devices])
        self.thermal_limit_c = arr([d.thermal_limit_c for d in devices])
        self.delta_t_c = arr([d.delta_t_c for d in devices])
        self.speed = arr([d.speed for d in devices])
        self.slots = arr([d.slots for d in devices])
        self.load = arr([d.load for d in devices])
        self.battery = arr(
            [(d.battery_percent / 100.0) if d.battery_percent is not None else 1.0 for d in devices]
        )
        self.on_battery = np.array([d.on_battery for d in devices], dtype=bool)
        self.alive = np.array([not d.failed for d in devices], dtype=bool)
        self.network_rtt_ms = arr([d.network_rtt_ms for d in devices])
        self.mobile = np.array([DeviceClass(c).is_mobile for c in self.classes], dtype=bool)
        self.idle_s = arr([d.idle_s for d in devices])
        self.prefill_tps = arr([d.prefill_tokens_per_s for d in devices])
        self.decode_tps = arr([d.decode_tokens_per_s for d in devices])
        self.backlog_s = arr(
            [
                d.backlog_s if d.backlog_s is not None else wait_by_load(d.load, d.slots, d.speed)
                for d in devices
            ]
        )
        self._derive(slice(None))
        #: Bumped by every change of live state (memoised per-task values are then stale).
        self.version = 0
        self._earliest: tuple[Task, int, float] | None = None
        self.blocks: FleetBlocks | None = None
        if block_size is not None and len(self) >= MIN_BLOCKS * block_size:
            self.blocks = FleetBlocks(self, block_size)

    def __len__(self) -> int:
        return len(self.ids)

    # -- time estimates ---------------------------------------------------------------------
    def service_s(self, task: Task, at: At = slice(None)) -> F64:
        """Seconds ``task`` takes on each device once started: its prefill and decode at the
        device's token rates where known, else ``work / speed``."""
        if task.output_tokens <= 0:
            return np.asarray(task.work / self.speed[at])
        return service_seconds(task, self.speed[at], self.prefill_tps[at], self.decode_tps[at])

    def marginal_j(self, task: Task, sleep_after_s: float = energy.SLEEP_AFTER_S) -> F64:
        """Joules ``task`` would add on each device (``energy.marginal_joules``), devices
        sleeping ``sleep_after_s`` after their last work."""
        return np.asarray(
            energy.marginal_joules(
                self.service_s(task),
                self.power_idle_w,
                self.power_max_w,
                self.slots,
                self.load > 0,
                self.idle_s,
                sleep_after_s,
            )
        )

    def completion_s(self, task: Task, at: At = slice(None)) -> F64:
        """Expected seconds from now until ``task`` would finish on each device: the wait for
        a slot plus its own service time (what HEFT-style list scheduling minimises)."""
        return np.asarray(self.backlog_s[at] + self.service_s(task, at))

    def earliest_s(self, task: Task, floor: F64 | None = None) -> float:
        """The earliest expected completion of ``task`` among live devices (among all when
        none is alive), i.e. ``lowest(completion_s(task), alive)``, exactly; remembered until
        the fleet changes. ``floor``: ``completion_floor(task)`` where the caller has it."""
        memo = self._earliest
        if memo is not None and memo[0] is task and memo[1] == self.version:
            return memo[2]
        if self.blocks is None or not self.alive.any():
            value = lowest(self.completion_s(task), self.alive)
        else:
            if floor is None:
                floor = self.completion_floor(task)
            value = self._earliest_by_blocks(task, self.blocks, floor)
        self._earliest = (task, self.version, value)
        return value

    def completion_floor(self, task: Task) -> F64:
        """Per block, a value no live member's ``completion_s(task)`` is below (+inf for a
        block without a live device); needs ``blocks``."""
        assert self.blocks is not None
        return self.blocks.floor(task.work, task.prompt_tokens, task.output_tokens)

    def _earliest_by_blocks(self, task: Task, blocks: FleetBlocks, floor: F64) -> float:
        first = int(floor.argmin())
        best = self._lowest_in(task, blocks, slice(first, first + 1))
        more = (floor < best).nonzero()[0]
        if more.size:
            best = min(best, self._lowest_in(task, blocks, more))
        return best

    def _lowest_in(
        self, task: Task, blocks: FleetBlocks, at: slice | npt.NDArray[np.intp]
    ) -> float:
        """The least completion among the live devices of blocks ``at`` (inf: none alive).
        Only the rows it reads are taken from the blocks' table."""
        flat, size = blocks.flat, blocks.blocks.size
        columns: slice | npt.NDArray[np.intp]
        if isinstance(at, slice):
            columns = slice(at.start * size, at.stop * size)
        else:
            columns = (at[:, None] * size + np.arange(size)).ravel()
        if task.output_tokens <= 0:  # what ``service_seconds`` gives, without its mask
            service = task.work / flat[blocks.SPEED, columns]
        else:
            service = service_seconds(
                task,
                flat[blocks.SPEED, columns],
                flat[blocks.PREFILL, columns],
                flat[blocks.DECODE, columns],
            )
        completion = flat[blocks.LIVE_BACKLOG, columns] + service
        # The value ``min`` gives, found by ``argmin`` (the cheaper of the two in numpy).
        return float(completion[completion.argmin()])

    def _changed(self, i: int) -> None:
        """Device ``i``'s live state changed."""
        self.version += 1
        if self.blocks is not None:
            self.blocks.changed(self, i)

    def _derive(self, where: slice | int) -> None:
        """Recompute the values derived from live state (all devices, or one)."""
        if isinstance(where, slice):
            self.max_intensity_power = energy.max_intensity_for_power(
                self.power_idle_w, self.power_max_w, self.power_now_w
            )
            self.max_intensity_heat = energy.max_intensity_for_heat(
                self.temperature_c, self.delta_t_c, self.thermal_limit_c
            )
            return
        i = where
        self._derive_one(
            i,
            float(self.power_idle_w[i]),
            float(self.power_max_w[i]),
            float(self.power_now_w[i]),
            float(self.temperature_c[i]),
            float(self.delta_t_c[i]),
        )

    def _derive_one(
        self,
        i: int,
        power_idle: float,
        power_max: float,
        power_now: float,
        temperature: float,
        delta_t: float,
    ) -> None:
        """``_derive`` for device ``i``, from its values in hand: ``energy.max_intensity_for_
        power`` and ``max_intensity_for_heat`` in plain floats, the same operations in the same
        order."""
        dynamic = max(power_max - power_idle, 1e-9)
        budget = max(power_max - power_now, 0.0)
        self.max_intensity_power[i] = budget / dynamic - energy.TASK_OVERHEAD_SHARE
        headroom = float(self.thermal_limit_c[i]) - temperature
        self.max_intensity_heat[i] = headroom / max(delta_t, 1e-9)

    def assign(self, i: int, task: Task) -> None:
        """Account for ``task`` starting on device ``i``: memory, power, heat, load and the
        wait it adds (its time shared by the slots, once it fills the last free one)."""
        # Plain floats: the same arithmetic as on numpy's, without its cost per element.
        slots, load = float(self.slots[i]), float(self.load[i])
        if load + 1.0 / slots >= 1.0 - 1e-9:  # it fills the last free slot
            self.backlog_s[i] = float(self.backlog_s[i]) + self._service_one(task, i) / slots
        self.memory_free_gb[i] = float(self.memory_free_gb[i]) - task.memory_gb
        idle_w, max_w = float(self.power_idle_w[i]), float(self.power_max_w[i])
        power_now = float(self.power_now_w[i]) + energy.estimated_power_w(
            idle_w, max_w, task.intensity
        )
        self.power_now_w[i] = power_now
        delta_t = float(self.delta_t_c[i])
        temperature = float(self.temperature_c[i]) + delta_t * task.intensity
        self.temperature_c[i] = temperature
        self.load[i] = load + 1.0 / slots
        self.idle_s[i] = 0.0
        self._derive_one(i, idle_w, max_w, power_now, temperature, delta_t)
        self._changed(i)

    def _service_one(self, task: Task, i: int) -> float:
        """``service_s(task, i)`` in plain floats (the same IEEE arithmetic, one device)."""
        by_work = task.work / float(self.speed[i])
        if task.output_tokens <= 0:
            return by_work
        prefill, decode = float(self.prefill_tps[i]), float(self.decode_tps[i])
        if prefill > 0 and decode > 0:
            return task.prompt_tokens / prefill + task.output_tokens / decode
        return by_work

    def set_live_state(
        self,
        i: int,
        *,
        load: float,
        memory_free_gb: float,
        power_now_w: float,
        temperature_c: float,
        battery: float | None,
        alive: bool,
        backlog_s: float | None = None,
        prefill_tokens_per_s: float | None = None,
        decode_tokens_per_s: float | None = None,
        idle_s: float = 0.0,
    ) -> None:
        """Overwrite device ``i``'s live state (a simulator or a fresh reading)."""
        self.load[i] = load
        self.idle_s[i] = idle_s
        if prefill_tokens_per_s is not None:
            self.prefill_tps[i] = prefill_tokens_per_s
        if decode_tokens_per_s is not None:
            self.decode_tps[i] = decode_tokens_per_s
        if backlog_s is None:
            backlog_s = wait_by_load(load, float(self.slots[i]), float(self.speed[i]))
        self.backlog_s[i] = backlog_s
        self.memory_free_gb[i] = memory_free_gb
        self.power_now_w[i] = power_now_w
        self.temperature_c[i] = temperature_c
        if battery is not None:
            self.battery[i] = battery
        self.alive[i] = alive
        self._derive(i)
        self._changed(i)

    def fail(self, device_id: str) -> int:
        i = self.index[device_id]
        self.alive[i] = False
        self._changed(i)
        return i
