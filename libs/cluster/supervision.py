"""When ``tessera up`` starts an exited service again, as systemd's ``Restart=on-failure``
would: after a backoff that doubles with each restart in the window (0.5 s, 1 s, 2 s, … up to
``MAX_BACKOFF_S``), and never more than ``BURST`` times in ``WINDOW_S``: past that the service
keeps crashing, is marked failed, and the rest of the cluster goes on without it. Pure: the
launcher's loop asks, and does what it is told.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Restarts allowed in ``WINDOW_S`` before a service is given up (systemd's StartLimitBurst).
BURST = 5
WINDOW_S = 120.0
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 30.0


@dataclass
class ServiceState:
    """What ``tessera status`` shows of one service."""

    state: str = "running"  #: running, restarting or failed
    restarts: int = 0  #: since the cluster started
    last_exit: str = ""  #: how it last ended ("exited with code 1", "killed by SIGKILL")
    #: When it was restarted, within the window (monotonic seconds).
    recent: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {"state": self.state, "restarts": self.restarts, "last_exit": self.last_exit}


@dataclass
class Supervisor:
    services: dict[str, ServiceState] = field(default_factory=dict)

    def exited(self, name: str, how: str, now: float) -> float | None:
        """``name`` exited (``how``): the seconds to wait before starting it again, or None
        when it has been restarted ``BURST`` times in ``WINDOW_S`` (it is marked failed)."""
        service = self.services.setdefault(name, ServiceState())
        service.last_exit = how
        service.recent = [t for t in service.recent if now - t < WINDOW_S]
        if len(service.recent) >= BURST:
            service.state = "failed"
            return None
        service.state = "restarting"
        return float(min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2.0 ** len(service.recent)))

    def restarted(self, name: str, now: float) -> None:
        service = self.services.setdefault(name, ServiceState())
        service.recent.append(now)
        service.restarts += 1
        service.state = "running"

    def failed(self, name: str) -> bool:
        service = self.services.get(name)
        return service is not None and service.state == "failed"

    def report(self) -> dict[str, dict[str, object]]:
        return {name: s.as_dict() for name, s in sorted(self.services.items())}
