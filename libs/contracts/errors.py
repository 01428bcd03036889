"""The one error a message that breaks its contract raises."""

from __future__ import annotations


class ContractError(ValueError):
    """A message that does not fit its contract. ``reason`` is short and bounded, for counting.

    A durable consumer's handler raises it for a message that can never be handled, whoever
    tries: the message is terminated, not delivered again (``libs/runtime/acks.py``); any
    other exception counts as transient, and the message is delivered again."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
