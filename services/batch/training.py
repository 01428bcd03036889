"""An elastic training job: a small PyTorch model trained for N steps, checkpointed so it can move.

Every ``every`` steps the job writes its state (weights, optimiser, step, attempt) to shared
storage, atomically (each writer its own file, then renamed). Started again anywhere, it
resumes from the checkpoint's step. Each step's batch is drawn from a generator seeded by the
step, so a run that moved ends with exactly the weights of one that never stopped. ``attempt``
grows with each dispatch: an older attempt that finds a newer one's checkpoint stops (it was
superseded). ``stop`` (asked every ``STOP_EVERY_S``) ends a run early, checkpointed at the step
it reached: the run is elastic, preempted here and resumed there.

``seed`` draws another run of the same model (its initial weights and its batches).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

#: How often a run asks ``stop`` (s).
STOP_EVERY_S = 0.2
_SEEDED = threading.Lock()


@dataclass(frozen=True)
class TrainResult:
    job_id: str
    device_id: str
    attempt: int
    resumed_from: int
    final_step: int
    loss: float
    weights_sha256: str
    first_step_at: float | None
    superseded: bool = False
    #: Ended early by ``stop``, checkpointed at ``final_step``.
    stopped: bool = False


def make_model(seed: int = 0) -> nn.Module:
    """The model's initial weights, drawn from torch's one global generator: seeded and drawn
    under a lock, as a worker's threads start runs side by side (unlocked, one run's seed
    could draw another's weights)."""
    with _SEEDED:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))


def batch(step: int, size: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1_000 + step + 1_000_003 * seed)
    x = torch.randn(size, 16, generator=generator)
    y = (x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True)).tanh()
    return x, y


def weights_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().numpy().tobytes())
    return digest.hexdigest()


def train(
    job_id: str,
    steps: int,
    checkpoint_dir: Path,
    *,
    device_id: str = "local",
    attempt: int = 1,
    every: int = 5,
    step_s: float = 0.0,
    on_step: Callable[[int], None] | None = None,
    seed: int = 0,
    stop: Callable[[], bool] | None = None,
) -> TrainResult:
    """Train to ``steps``, resuming from ``checkpoint_dir/<job_id>.pt`` when there is one."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    path = checkpoint_dir / f"{job_id}.pt"
    model = make_model(seed)
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = 0
    if path.exists():
        state = torch.load(path, weights_only=True)
        if int(state["attempt"]) > attempt:
            done = int(state["step"])
            return _result(job_id, device_id, attempt, done, done, model, 0.0, None, True)
        model.load_state_dict(state["model"])
        optimiser.load_state_dict(state["optimiser"])
        start = int(state["step"])
        loss = torch.tensor(float(state.get("loss", 0.0)))
    else:
        loss = torch.tensor(0.0)
    first_step_at = None
    asked = time.monotonic()
    for step in range(start, steps):
        if stop is not None and time.monotonic() - asked >= STOP_EVERY_S:
            asked = time.monotonic()
            if stop():
                _save(path, model, optimiser, step, attempt, loss.item())
                return _result(
                    job_id, device_id, attempt, start, step, model, loss.item(),
                    first_step_at, False, stopped=True,
                )  # fmt: skip
        x, y = batch(step, seed=seed)
        optimiser.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimiser.step()
        first_step_at = first_step_at or time.time()
        if (step + 1) % every == 0 or step + 1 == steps:
            _save(path, model, optimiser, step + 1, attempt, loss.item())
        if on_step is not None:
            on_step(step + 1)
        if step_s:
            time.sleep(step_s)
    final = max(start, steps)
    return _result(
        job_id, device_id, attempt, start, final, model, loss.item(), first_step_at, False
    )


def checkpoint_step(checkpoint_dir: Path, job_id: str) -> int:
    """The step of a job's last checkpoint (0 when there is none)."""
    path = checkpoint_dir / f"{job_id}.pt"
    return int(torch.load(path, weights_only=True)["step"]) if path.exists() else 0


def _save(
    path: Path,
    model: nn.Module,
    optimiser: torch.optim.Optimizer,
    step: int,
    attempt: int,
    loss: float,
) -> None:
    state = {
        "model": model.state_dict(),
        "optimiser": optimiser.state_dict(),
        "step": step,
        "attempt": attempt,
        "loss": loss,
    }
    # A writer's own partial file: an attempt stopping as a newer one starts never writes
    # into the file the other renames.
    partial = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.partial")
    torch.save(state, partial)
    partial.replace(path)


def _result(
    job_id: str,
    device_id: str,
    attempt: int,
    start: int,
    final: int,
    model: nn.Module,
    loss: float,
    first_step_at: float | None,
    superseded: bool,
    stopped: bool = False,
) -> TrainResult:
    return TrainResult(
        job_id=job_id,
        device_id=device_id,
        attempt=attempt,
        resumed_from=start,
        final_step=final,
        loss=loss,
        weights_sha256=weights_digest(model),
        first_step_at=first_step_at,
        superseded=superseded,
        stopped=stopped,
    )
