"""A process that stops or exits inside a gate is named within ``gate.collective_timeout_s``, never waited for in
silence (docs/distributed.md#a-stalled-or-dead-rank): two gloo processes, rank 1 stops itself (SIGSTOP) or exits
in gate 10's canary forward, and rank zero records the failed gate in ``errors.jsonl`` naming rank 1 and the step.
Without the bound rank zero waits for the process group's own timeout (30 minutes): ``run_workers`` gives up
after 120 s."""

from __future__ import annotations

import pytest

from atlas_tracking.testing.distributed import run_workers
from atlas_tracking.testing.lost_rank import gate_with_a_lost_rank

TIMEOUT_S = 5.0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stop", "exit"])
def test_a_lost_rank_is_named_by_rank_zero_within_the_timeout(how):
    zero, one = run_workers(gate_with_a_lost_rank, 2, how, TIMEOUT_S, timeout=120, lost=(1,))
    assert zero["first"] == "BASELINE" and zero["second"] is None  # gate 10 failed and training goes on
    line, again = zero["errors"]
    assert line["step"] == 10 and line["alerts"][0]["level"] == "ERROR"
    assert line["error"].startswith("RanksUnresponsive: rank 1 did not reach the gate's collective"), line["error"]
    assert "at step 10 within gate.collective_timeout_s = 5 s" in line["error"]
    # a stopped process is waited for the bound and no longer; an exited one is named at once
    low, high = (TIMEOUT_S - 0.5, TIMEOUT_S + 5.0) if how == "stop" else (0.0, TIMEOUT_S)
    assert low <= zero["seconds"] <= high, zero["seconds"]
    # the next gate does not wait again: it fails at once, naming the same process
    assert zero["third"] is None and zero["again"] < 1.0, zero["again"]
    assert again["step"] == 20 and again["error"].startswith("RanksUnresponsive: rank 1 did not reach"), again
    if how == "stop":  # woken after rank zero gave up: its own gates fail too, it does not hang
        assert one["second"] is None and one["third"] is None
    else:
        assert one is None
