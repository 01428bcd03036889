"""What a shard engine asks the worker service to do, and the packing of hidden states into
``STEP`` frames (a step's rows for several requests per frame, as few frames as fit)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from libs.contracts import Frame, StepRow, TokenChunk, step_frame
from libs.contracts.frames import MAX_FRAME_BYTES

#: Bytes a step frame may fill (NATS' payload limit less room for the header).
FRAME_BUDGET = MAX_FRAME_BYTES - 64 * 1024


@dataclass(frozen=True)
class Send:
    device_id: str
    frame: Frame
    opens: bool = False  #: it carries a request's first rows (the trace goes with it)


@dataclass(frozen=True)
class Emit:
    chunk: TokenChunk


Action = Send | Emit


def states_frames(
    epoch: int, device_id: str, parts: list[tuple[StepRow, torch.Tensor]]
) -> list[Action]:
    """Each request's rows and their hidden states, sent to ``device_id`` in as few frames as
    fit ``FRAME_BUDGET``."""
    frames: list[Action] = []
    batch: list[tuple[StepRow, torch.Tensor]] = []
    size = 0
    for row, states in parts:
        cost = states.numel() * 4 + len(row.model_dump_json()) + 16
        if batch and size + cost > FRAME_BUDGET:
            frames.append(_frame(epoch, device_id, batch))
            batch, size = [], 0
        batch.append((row, states))
        size += cost
    frames.append(_frame(epoch, device_id, batch))
    return frames


def frame_states(frame: Frame) -> torch.Tensor:
    """The hidden states a ``STEP`` frame carries (none for tokens and ENDs)."""
    if not frame.shape:
        return torch.empty(0)
    return torch.frombuffer(bytearray(frame.data), dtype=torch.float32).reshape(frame.shape)


def _frame(epoch: int, device_id: str, batch: list[tuple[StepRow, torch.Tensor]]) -> Send:
    states = torch.cat([s for _, s in batch]).contiguous()
    rows = [row for row, _ in batch]
    frame = step_frame(epoch, rows, states.numpy().tobytes(), tuple(states.shape))
    return Send(device_id, frame, opens=any(row.request is not None for row in rows))
