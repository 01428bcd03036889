"""Devices grouped into fixed-size blocks, for searches that skip whole blocks by a bound.

A large fleet's best device for a task is found without scoring every device: each block keeps
bounds of what its devices can score (the most any member's value can be), blocks are visited
best bound first, and a block whose bound is below the best score found so far is skipped.
Bounds only ever widen between rebuilds (a changed device widens its block's bounds to cover
it), so a stale bound is loose, never wrong, and the search returns exactly what scoring every
device would.

Blocks are formed fastest device first, so that devices of similar speed (the term that decides
the expected completion) share a block and the blocks' bounds are tight.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import numpy.typing as npt

from libs.core.capability import Num

F64 = npt.NDArray[np.float64]
Bool = npt.NDArray[np.bool_]
Index = npt.NDArray[np.intp]

#: Devices per block: small enough that a visited block costs little, large enough that the
#: per-block bounds (a few arrays over the blocks) stay cheap for 100,000 devices. Counted in
#: instructions on the bench's 10,000 devices (placing 1,000 tasks, under callgrind): 128
#: takes 7 % fewer than 256, and 64 16 % more (its searches take more steps).
BLOCK_SIZE = 128
#: Fewer blocks than this and the pipeline scores every device (measured with blocks of 256 on
#: the bench's fleets: 8,000 devices 9,857 against 8,400 placements/s, 10,000 devices 8,484
#: against 9,153; with blocks of 128, fleets from 4,608 devices are searched by block).
MIN_BLOCKS = 36


def allowed_intensity(power: Num, heat: Num) -> Num:
    """The largest task intensity that passes both the power filter (``power >= intensity``)
    and the thermal one (``heat > intensity``), from the largest each allows: ``allowed >=
    intensity`` exactly when both pass, as ``heat > x`` is ``heat``'s predecessor among
    doubles ``>= x``. Arrays or one device's floats (NaN anywhere gives NaN, as ``np.minimum``)."""
    if isinstance(power, float) and isinstance(heat, float):
        below = math.nextafter(heat, -math.inf)
        return power if power <= below or power != power else below
    return np.minimum(power, np.nextafter(heat, -np.inf))


class Blocks:
    """A partition of ``n`` devices into blocks of ``size``; ``members`` is (blocks, size).

    The last block is padded by repeating its last device: a device seen twice scores the
    same twice, so the padding changes no minimum, maximum or arg-best (ties go to the lowest
    device index, which a repeat does not change).
    """

    def __init__(self, speed: F64, size: int = BLOCK_SIZE) -> None:
        if size < 1:
            raise ValueError("block size must be positive")
        n = len(speed)
        order = np.argsort(-speed, kind="stable")
        self.count = -(-n // size)
        self.size = size
        padding = np.repeat(order[-1:], self.count * size - n)
        self.members: npt.NDArray[np.intp] = np.concatenate([order, padding]).reshape(
            self.count, size
        )
        #: Each device's block, and its place in ``members.ravel()``.
        self.of: Index = np.empty(n, dtype=np.intp)
        self.of[order] = np.arange(n) // size
        self.slot: Index = np.empty(n, dtype=np.intp)
        self.slot[order] = np.arange(n)
        #: True on the places of ``members`` that repeat a device to fill the last block.
        self.padding: Bool = (np.arange(self.count * size) >= n).reshape(self.count, size)

    def rows(self, blocks: Index) -> Index:
        """The device indices of ``blocks``, in one array."""
        return self.members[blocks].ravel()

    def max(self, values: F64, where: Bool | None = None, empty: float = -np.inf) -> F64:
        """Each block's largest value (over ``where``; ``empty`` for a block with none)."""
        grid = values[self.members]
        if where is not None:
            grid = np.where(where[self.members], grid, empty)
        return np.asarray(grid.max(axis=1), dtype=np.float64)

    def min(self, values: F64, where: Bool | None = None, empty: float = np.inf) -> F64:
        """Each block's smallest value (over ``where``; ``empty`` for a block with none)."""
        return -self.max(-values, where, -empty)

    def columns_max(self, matrix: F64, where: Bool | None = None) -> F64:
        """Per block, the largest value of each column of ``matrix`` (n, k): (blocks, k)."""
        grid = matrix[self.members]
        if where is not None:
            grid = np.where(where[self.members][:, :, None], grid, -np.inf)
        return np.asarray(grid.max(axis=1), dtype=np.float64)


class FleetColumns(Protocol):
    """What of a fleet the blocks read, one entry per device (``libs/core/fleet_state.FleetState``,
    which builds its ``FleetBlocks`` over itself)."""

    @property
    def alive(self) -> Bool: ...
    @property
    def speed(self) -> F64: ...
    @property
    def prefill_tps(self) -> F64: ...
    @property
    def decode_tps(self) -> F64: ...
    @property
    def backlog_s(self) -> F64: ...
    @property
    def memory_free_gb(self) -> F64: ...
    @property
    def max_intensity_power(self) -> F64: ...
    @property
    def max_intensity_heat(self) -> F64: ...
    @property
    def capability_unit(self) -> F64:
        """(devices, dimensions): each device's capability scaled to unit length."""

    @property
    def capability_unit_t(self) -> F64:
        """The same, one row per dimension."""


class FleetBlocks:
    """A fleet's values in block order (``table``: one row per quantity, each (blocks, size))
    and per block bounds over its live devices, kept current as devices change.

    Rows: the device's index, 1 if it is alive (else 0), free memory, the largest intensity
    its power and its heat allow, its backlog, speed, prefill and decode rates, its unit
    capability per dimension, its backlog again where it is alive, +inf where not (the
    least completion of a block is then one sum and one minimum, with no mask), and the
    largest intensity both its power and its heat allow (``allowed_intensity``: one
    comparison for the two filters).
    """

    INDEX, ALIVE, MEMORY, POWER, HEAT, BACKLOG, SPEED, PREFILL, DECODE = range(9)
    CAPABILITY = slice(9, 14)
    LIVE_BACKLOG = 14
    ALLOW = 15

    def __init__(self, fleet: FleetColumns, size: int = BLOCK_SIZE) -> None:
        self.blocks = blocks = Blocks(fleet.speed, size)
        alive = fleet.alive
        known = alive & (fleet.prefill_tps > 0) & (fleet.decode_tps > 0)
        # Bounds over live devices: the least backlog, the largest of everything else.
        self.backlog = blocks.min(fleet.backlog_s, alive)
        self.speed = blocks.max(fleet.speed, alive, empty=1.0)
        self.prefill = blocks.max(fleet.prefill_tps, known, empty=0.0)
        self.decode = blocks.max(fleet.decode_tps, known, empty=0.0)
        self.memory = blocks.max(fleet.memory_free_gb, alive)
        self.power = blocks.max(fleet.max_intensity_power, alive)
        self.heat = blocks.max(fleet.max_intensity_heat, alive)
        allow = allowed_intensity(fleet.max_intensity_power, fleet.max_intensity_heat)
        self.allow = blocks.max(allow, alive)
        self.capability = blocks.columns_max(fleet.capability_unit, alive)
        columns = [
            np.arange(len(fleet.speed), dtype=np.float64),
            alive.astype(np.float64),
            fleet.memory_free_gb,
            fleet.max_intensity_power,
            fleet.max_intensity_heat,
            fleet.backlog_s,
            fleet.speed,
            fleet.prefill_tps,
            fleet.decode_tps,
            *fleet.capability_unit_t,
            np.where(alive, fleet.backlog_s, np.inf),
            allow,
        ]
        self.table = np.stack(columns)[:, blocks.members]
        self.table[self.ALIVE][blocks.padding] = 0.0  # a repeated device counts once
        self.table[self.LIVE_BACKLOG][blocks.padding] = np.inf
        #: ``table`` as (rows, devices in block order): a run of blocks is a run of columns.
        self.flat = self.table.reshape(len(self.table), -1)

    def changed(self, fleet: FleetColumns, i: int) -> None:
        """Device ``i``'s live state changed: copy it, and widen its block's bounds to cover
        it (a bound never tightens until the next build: loose is allowed, wrong is not).
        In plain floats: this runs once per placement, on one device."""
        flat, s = self.flat, int(self.blocks.slot[i])
        memory = float(fleet.memory_free_gb[i])
        power = float(fleet.max_intensity_power[i])
        heat = float(fleet.max_intensity_heat[i])
        backlog = float(fleet.backlog_s[i])
        prefill = float(fleet.prefill_tps[i])
        decode = float(fleet.decode_tps[i])
        alive = bool(fleet.alive[i])
        was_alive = flat[self.ALIVE, s] == 1.0
        flat[self.MEMORY, s] = memory
        flat[self.POWER, s] = power
        flat[self.HEAT, s] = heat
        allow = allowed_intensity(power, heat)
        flat[self.ALLOW, s] = allow
        flat[self.BACKLOG, s] = backlog
        flat[self.PREFILL, s] = prefill
        flat[self.DECODE, s] = decode
        flat[self.ALIVE, s] = 1.0 if alive else 0.0
        flat[self.LIVE_BACKLOG, s] = backlog if alive else np.inf
        if not alive:
            return
        b = int(self.blocks.of[i])
        if backlog < self.backlog[b]:
            self.backlog[b] = backlog
        if not was_alive:  # its speed and capability never change: widened when it revives
            speed = float(flat[self.SPEED, s])
            if speed > self.speed[b]:
                self.speed[b] = speed
            np.maximum(self.capability[b], flat[self.CAPABILITY, s], out=self.capability[b])
        if prefill > 0 and decode > 0:
            if prefill > self.prefill[b]:
                self.prefill[b] = prefill
            if decode > self.decode[b]:
                self.decode[b] = decode
        if memory > self.memory[b]:
            self.memory[b] = memory
        if power > self.power[b]:
            self.power[b] = power
        if heat > self.heat[b]:
            self.heat[b] = heat
        if allow > self.allow[b]:
            self.allow[b] = allow

    def floor(self, work: float, prompt_tokens: int, output_tokens: int) -> F64:
        """Per block, a value no live member's expected completion (backlog + service) is
        below, +inf for a block without a live device. Rounding cannot break it: division and
        addition are monotone, and the floor divides by the block's largest rates."""
        service = work / self.speed
        if output_tokens > 0:
            known = (self.prefill > 0) & (self.decode > 0)
            by_tokens = prompt_tokens / np.where(known, self.prefill, 1.0) + (
                output_tokens / np.where(known, self.decode, 1.0)
            )
            service = np.minimum(service, np.where(known, by_tokens, np.inf))
        return np.asarray(self.backlog + service)
