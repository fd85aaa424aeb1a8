"""Request options from the flat tables tests write them in."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from zerobubble.request_options import SamplingOptions, StoppingOptions

_STOPPING_FIELDS = frozenset(f.name for f in dataclasses.fields(StoppingOptions))


def split_options(params: Mapping[str, Any]) -> tuple[SamplingOptions, StoppingOptions]:
    """The sampling and stopping options of one mapping of their field names, e.g.
    ``{"temperature": 0.8, "max_tokens": 16}``; a name of neither is a TypeError."""
    stopping = {k: v for k, v in params.items() if k in _STOPPING_FIELDS}
    sampling = {k: v for k, v in params.items() if k not in _STOPPING_FIELDS}
    return SamplingOptions(**sampling), StoppingOptions(**stopping)
