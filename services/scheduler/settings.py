"""Scheduler settings (prefix ``TESSERA_SCHEDULER_``): a 200 ms decision cycle, checkpoints every
10 minutes, the balanced mode and DWPS unless set."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from libs.contracts import Mode
from libs.runtime.settings import ServiceSettings


class SchedulerSettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="TESSERA_SCHEDULER_", extra="ignore", populate_by_name=True
    )

    #: Requests arriving within one cycle are placed together (100–500 ms).
    cycle_ms: int = Field(200, ge=100, le=500)
    #: Scheduler state is checkpointed this often (every 10 minutes) and at shutdown.
    checkpoint_interval_s: float = Field(600.0, gt=0)
    #: After a restart, how long a restored plan's tasks wait for its devices to announce
    #: again before they go out anyway (a device that stays silent is then failed as usual).
    resume_wait_s: float = Field(60.0, ge=0)
    checkpoints_kept: int = Field(5, ge=1, le=100)
    #: How often the cluster's throughput and tokens/J are measured for mode switching.
    mode_eval_s: float = Field(10.0, gt=0)
    mode_dwell_s: float = Field(30.0, ge=0)
    policy: str = "dwps"
    mode: Mode = Mode.BALANCED
    http_host: str = "127.0.0.1"
    http_port: int = Field(8100, ge=0, le=65535)
    #: This replica's name in the leader lease (one leads; the others wait to take over).
    replica: str = Field("scheduler-0", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    #: The lease expires this long after the leader's last renewal (renewed every third).
    lease_s: float = Field(3.0, ge=1.0, le=60.0)
    #: A shard still loading whose worker reports nothing for this long is taken as failed
    #: and its deployment re-planned without that device. None: three of the device's
    #: telemetry intervals (2 s at least), as the scorer's failure detector allows its
    #: telemetry — workers report ``loading`` at once and every second while they load.
    shard_silence_s: float | None = Field(None, gt=0)
    #: Decisions kept in memory and in checkpoints (most recent first).
    decisions_kept: int = Field(1000, ge=0)
