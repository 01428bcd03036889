"""The one error a message that breaks its contract raises."""

from __future__ import annotations


class ContractError(ValueError):
    """A message that does not fit its contract. ``reason`` is short and bounded, for counting."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
