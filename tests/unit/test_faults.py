"""The fault injector a worker process under test reads from its environment (`faults_from_env`).

The chaos and multi-worker suites start real workers with these variables; here each fault is
checked on its own, without a model.
"""

from __future__ import annotations

import pytest

from zerobubble.api import worker_pb2
from zerobubble.rows import add_decode_columns
from zerobubble.worker_svc.faults import (
    DEVICE_FAULT_AT_STEP_ENV,
    FAIL_EVERY_NTH_DECODE_ROW_ENV,
    NO_FAULTS,
    faults_from_env,
)


def _plan(step_id: int, decodes: list[str], prefills: list[str]) -> worker_pb2.StepPlan:
    """A plan with ``decodes`` in the columns and a decode and prefill row as messages each."""
    plan = worker_pb2.StepPlan(step_id=step_id)
    add_decode_columns(plan, decodes, [0] * len(decodes), [0] * len(decodes), [])
    for req_id in prefills:
        plan.requests.add(req_id=req_id, token_ids=[1, 2, 3])
    plan.requests.add(req_id=f"m{step_id}")  # a decode row sent as a message
    return plan


def test_no_variable_injects_nothing() -> None:
    faults = faults_from_env({"PATH": "/bin", FAIL_EVERY_NTH_DECODE_ROW_ENV: "0", DEVICE_FAULT_AT_STEP_ENV: ""})
    assert faults is NO_FAULTS
    plan = _plan(1, ["a", "b"], ["p"])
    assert faults.step_fault(plan) is None
    assert faults.row_faults(plan) is None  # the decode columns stay checked at once
    assert all(faults.copy_fault(n) is None for n in range(1, 10))


def test_every_nth_decode_row_fails_across_steps_and_wire_forms() -> None:
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
