"""The request model's generic machinery: every declared control crosses each wire boundary and
reaches the OpenAI body without code of its own."""

from __future__ import annotations

import typing
from typing import Any

import pytest

from zerobubble.api import generate_pb2
from zerobubble.client import build_request
from zerobubble.request_options import (
    SamplingOptions,
    StoppingOptions,
    from_generate_request,
    from_worker_sampling,
    to_worker_sampling,
    wires,
    write_generate_request,
)
from zerobubble.scheduler_svc.openai_protocol import ChatCompletionBody, CompletionBody, body_controls

# A value other than the default for each Python type a control has (inside every range).
_OTHER: dict[Any, Any] = {
    float: 0.5,
    int: 2,
    int | None: 2,
    bool: True,
    dict[int, float]: {3: 0.5},
    list[int]: [2, 5],
    list[str]: ["x"],
}


def _changed(options: type) -> Any:
    """``options`` with every control set to a value other than its default."""
    hints = typing.get_type_hints(options)
    return options(**{name: _OTHER[hints[name]] for name, _ in wires(options)})


def test_every_control_survives_the_client_wire_and_the_plan_row() -> None:
    sampling, stopping = _changed(SamplingOptions), _changed(StoppingOptions)
    sampling.validate()
    stopping.validate()
    request = generate_pb2.GenerateRequest(prompt="hi")
    write_generate_request(sampling, stopping, request)
    read = from_generate_request(generate_pb2.GenerateRequest.FromString(request.SerializeToString()))
    assert read == (sampling, stopping)
    assert from_worker_sampling(to_worker_sampling(sampling, 0)) == sampling


def test_unset_fields_read_as_the_defaults() -> None:
    assert from_generate_request(generate_pb2.GenerateRequest(prompt="hi")) == (SamplingOptions(), StoppingOptions())


def test_build_request_writes_controls_by_name_and_refuses_other_names() -> None:
    request = build_request(prompt="hi", min_p=0.5, max_tokens=4, logprobs=True, temperature=None)
    sampling, stopping = from_generate_request(request)
    assert (sampling.min_p, stopping.max_tokens, sampling.logprobs) == (0.5, 4, True)
    assert not request.sampling.HasField("temperature")  # None: the server's default
    with pytest.raises(TypeError, match="tempurature"):
        build_request(prompt="hi", tempurature=0.5)


@pytest.mark.parametrize("model", [ChatCompletionBody, CompletionBody])
def test_every_body_control_is_a_body_parameter(model: type) -> None:
    names = body_controls(SamplingOptions) + body_controls(StoppingOptions)
    assert set(names) <= set(model.model_fields)
