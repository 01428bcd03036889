"""What one fault of the chaos harness did to the load (``Outcome``: requests by how they
ended, recovery and re-placement times) and the results as a Markdown table (``table``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from libs.harness import placement_faults


@dataclass
class Outcome:
    """One fault's run: each request counted as completed, failed, lost or corrupt."""

    fault: str
    counts: Counter[str] = field(default_factory=Counter)
    recovery_s: float | None = None
    elapsed_s: float = 0.0  #: the whole run of this fault's requests
    #: Supervised faults: from the kill until ``tessera up`` said the process was back (for a
    #: power cut, until the new ``tessera up`` said ``ready``).
    back_s: float | None = None
    #: Placement faults: requests sent to the refusing (or still loading) worker, and seconds
    #: from its refusal (or kill) until the model served again.
    misrouted: int | None = None
    replace_s: float | None = None

    def row(self) -> dict[str, Any]:
        row = {
            "completed": self.counts["completed"],
            "failed": self.counts["failed"],
            "lost": self.counts["lost"],
            "corrupt": self.counts["corrupt"],
            "retried": self.counts["retried"],
            "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 2),
            "elapsed_s": round(self.elapsed_s, 1),
        }
        if self.back_s is not None:
            row["back_s"] = round(self.back_s, 2)
        if self.fault in placement_faults.FAULTS:
            replace = None if self.replace_s is None else round(self.replace_s, 2)
            row.update(misrouted=self.misrouted, replace_s=replace)
        return row


def table(outcomes: list[Outcome]) -> str:
    """The results as a Markdown table."""
    lines = [
        "| fault | completed | failed | lost | corrupt | retried | recovery (s) | back (s) "
        "| misrouted | re-placement (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for o in outcomes:
        r = o.row()
        misrouted = r.get("misrouted", "")
        replace = r.get("replace_s", "")
        lines.append(
            f"| {o.fault} | {r['completed']} | {r['failed']} | {r['lost']} | {r['corrupt']} "
            f"| {r['retried']} "
            f"| {r['recovery_s'] if r['recovery_s'] is not None else 'not recovered'} "
            f"| {'' if o.back_s is None else round(o.back_s, 2)} "
            f"| {'' if misrouted is None else misrouted} "
            f"| {'not seen' if replace is None else replace} |"
        )
    return "\n".join(lines)
