"""The built-in scheduling profiles, one per mode (the types are in ``libs/contracts/profiles.py``).

They are the one source of the modes' weights: the scheduler and the scorer use them (or the
profile given with ``PUT /policy``), and so does the simulator.
"""

from __future__ import annotations

from typing import Any

from libs.contracts import Mode
from libs.contracts.profiles import DimensionWeights, Profile
from libs.core.energy import BREAK_EVEN_SLEEP_S


def _profile(mode: Mode, **kw: Any) -> Profile:
    return Profile(name=mode.value, mode=mode, **kw)


#: The built-in profiles. Performance raises α and β (urgent, complex work first) and weighs
#: compute; energy raises γ (fit) and weighs efficiency; balanced sits between. The load term
#: (δ) is ``completion``, the load in time units: the first design's queue-length form
#: (``load``) lost the tail to least-connections (p99 1.37× on the Azure trace, seed fleet)
#: because a queue on a fast device and one on a watch counted the same; docs/scheduling.md
#: has the figures.
BUILTIN_PROFILES: dict[Mode, Profile] = {
    Mode.BALANCED: _profile(
        Mode.BALANCED,
        urgency=0.3,
        complexity=0.2,
        dimensions=DimensionWeights(
            compute=0.3, memory=0.2, efficiency=0.2, network=0.15, stability=0.15
        ),
        scores={"device_match": 0.2, "capability": 0.1, "completion": 0.7},
    ),
    Mode.PERFORMANCE: _profile(
        Mode.PERFORMANCE,
        urgency=0.45,
        complexity=0.35,
        dimensions=DimensionWeights(
            compute=0.5, memory=0.2, efficiency=0.0, network=0.15, stability=0.15
        ),
        scores={"device_match": 0.05, "capability": 0.1, "completion": 0.85},
    ),
    Mode.ENERGY: _profile(
        Mode.ENERGY,
        urgency=0.2,
        complexity=0.1,
        dimensions=DimensionWeights(
            compute=0.05, memory=0.15, efficiency=0.6, network=0.05, stability=0.15
        ),
        filters=("alive", "memory", "power", "thermal", "battery_floor", "completion_slack"),
        scores={"energy": 0.8, "device_match": 0.1, "completion": 0.1},
        sleep_after_s=BREAK_EVEN_SLEEP_S,
    ),
}
