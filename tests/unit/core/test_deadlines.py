"""Admission by deadline (earliest deadline first): what a user submitting batches sees."""

from __future__ import annotations

import math

from libs.core.deadlines import Work, admit, edf_finishes


def test_work_that_fits_its_window_is_admitted_with_its_planned_end() -> None:
    decision = admit([], Work("b1", 600.0, deadline_s=3600.0), now=0.0)
    assert decision.admitted and decision.planned_finish_s == 600.0
    assert "10.0 min" in decision.reason


def test_work_longer_than_its_window_is_declined_saying_what_it_needs_and_what_is_free() -> None:
    ahead = [Work("early", 1800.0, deadline_s=2000.0)]
    decision = admit(ahead, Work("late", 2400.0, deadline_s=3600.0), now=0.0)
    assert not decision.admitted
    assert "needs about 40.0 min of serving" in decision.reason
    assert "deadline is in 60.0 min, of which 30.0 min is free" in decision.reason
    assert decision.planned_finish_s == 4200.0


def test_an_earlier_deadline_that_would_push_an_admitted_batch_past_its_own_is_declined() -> None:
    admitted = [Work("long", 3000.0, deadline_s=3300.0)]
    decision = admit(admitted, Work("urgent", 600.0, deadline_s=700.0), now=0.0)
    assert not decision.admitted
    assert "long, admitted before it, miss its deadline" in decision.reason
    # The same urgent batch beside one with room to spare is admitted, and runs first.
    roomy = [Work("long", 3000.0, deadline_s=7200.0)]
    assert admit(roomy, Work("urgent", 600.0, deadline_s=700.0), now=0.0).admitted
    assert edf_finishes([*roomy, Work("urgent", 600.0, 700.0)], 0.0) == {
        "urgent": 600.0,
        "long": 3600.0,
    }


def test_no_measured_throughput_declines_rather_than_guessing() -> None:
    decision = admit([], Work("b", math.inf, deadline_s=100.0), now=0.0)
    assert not decision.admitted and "no throughput" in decision.reason
