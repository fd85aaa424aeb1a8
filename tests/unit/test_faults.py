"""The fault injector a worker process under test reads from its environment (`faults_from_env`).

The chaos and multi-worker suites start real workers with these variables; here each fault is
checked on its own, without a model.
"""

from __future__ import annotations

import pytest

from zerobubble.api import worker_pb2
from zerobubble.rows import PlanBuilder
from zerobubble.worker_svc.faults import (
    DEVICE_FAULT_AT_STEP_ENV,
    FAIL_EVERY_NTH_DECODE_ROW_ENV,
    NO_FAULTS,
    faults_from_env,
)


def _plan(step_id: int, decodes: list[str], prefills: list[str]) -> worker_pb2.StepPlan:
    """A plan with the leading decode rows ``decodes``, then a prefill chunk per ``prefills``
    and a decode row after them."""
    builder = PlanBuilder()
    for req_id in decodes:
        builder.add_decode(req_id, 0)
    for req_id in prefills:
        builder.add(req_id, [1, 2, 3])
    builder.add(f"m{step_id}")  # a decode row after the chunks
    plan = worker_pb2.StepPlan(step_id=step_id)
    builder.write(plan)
    return plan


def test_no_variable_injects_nothing() -> None:
    faults = faults_from_env({"PATH": "/bin", FAIL_EVERY_NTH_DECODE_ROW_ENV: "0", DEVICE_FAULT_AT_STEP_ENV: ""})
    assert faults is NO_FAULTS
    plan = _plan(1, ["a", "b"], ["p"])
    assert faults.step_fault(plan) is None
    assert faults.row_faults(plan) is None  # the leading decode rows stay checked at once
    assert all(faults.copy_fault(n) is None for n in range(1, 10))


def test_every_nth_decode_row_fails_across_steps_wherever_the_row_is() -> None:
    faults = faults_from_env({FAIL_EVERY_NTH_DECODE_ROW_ENV: "2"})
    # Decode rows in order: a, b, m1 | c, m2 (prefill chunks never count).
    first = faults.row_faults(_plan(1, ["a", "b"], ["p"]))
    second = faults.row_faults(_plan(2, ["c"], ["q"]))
    assert first is not None and second is not None
    assert list(first) == ["b"] and list(second) == ["c"]
    assert "injected test fault" in first["b"] and first["b"].startswith("request b:")
    assert faults.copy_fault(1) is None


@pytest.mark.parametrize("at_step", [1, 3])
def test_the_result_copy_of_one_step_fails_as_a_device_fault(at_step: int) -> None:
    faults = faults_from_env({DEVICE_FAULT_AT_STEP_ENV: str(at_step)})
    assert faults.row_faults(_plan(1, ["a"], [])) is None
    events = [faults.copy_fault(n) for n in range(1, 5)]
    assert [n for n, e in enumerate(events, 1) if e is not None] == [at_step]
    event = events[at_step - 1]
    assert event is not None
    with pytest.raises(RuntimeError, match="CUDA error: an illegal memory access"):
        event.synchronize()
