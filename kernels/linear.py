"""Linear layers over weights laid out once, at load time, for the device that runs them.

On CPU, ``F.linear`` hands a plain ``[out, in]`` weight to MKL, which repacks it on every call;
for the few-row inputs of decoding that repacking costs more than the product itself. oneDNN's
inner product over a weight reordered once into its blocked layout is 25-40% faster for float32
inputs of 4 to ~64 rows (decode batches, verification rows) and for bfloat16 inputs of any size
(``scripts/bench_model.py --no-prepack`` measures the difference). For 1-3 float32 rows MKL's gemv
over the plain weight is still the faster one, so float32 weights keep both copies and pick per
call; bfloat16 weights keep only the packed one.

On CUDA, or where oneDNN is missing, a weight is just the plain tensor for ``F.linear``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# The row count oneDNN chooses its blocked layout for: a decode batch. The layout serves any row count.
_PACK_ROWS_HINT = 16
# Below this many float32 rows MKL's gemv over the plain weight beats the packed product.
_F32_MIN_PACKED_ROWS = 4


@dataclass(slots=True, eq=False)
class LinearWeight:
    """One ``[out, in]`` linear weight: the plain tensor and/or a oneDNN-packed copy.

    ``packed`` is used for inputs of at least ``min_packed_rows`` rows, ``dense`` otherwise.
    """

    dense: torch.Tensor | None
    packed: torch.Tensor | None = None
    min_packed_rows: int = 0


def prepare_linear(weight: torch.Tensor, prepack: bool = True) -> LinearWeight:
    """Wrap ``weight`` ``[out, in]`` for :func:`linear`, packing it for oneDNN when that helps here."""
    if not (prepack and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()):  # fmt: skip
        return LinearWeight(weight)
    try:
        # Without native bfloat16 instructions oneDNN would emulate them; plain F.linear is no worse.
        if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return LinearWeight(weight)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
    except (AttributeError, RuntimeError) as exc:  # a torch build without this oneDNN op or ISA
        logger.warning("oneDNN weight packing unavailable, using plain F.linear: %s", exc)
        return LinearWeight(weight)
    if weight.dtype == torch.float32:
        return LinearWeight(weight, packed, _F32_MIN_PACKED_ROWS)
    return LinearWeight(None, packed, 0)


def linear(
    x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias (+ residual)`` for ``x`` ``[N, in]``, through the packed weight when
    ``N`` is large enough.

    For float32 oneDNN adds ``residual`` as it writes the output: the same sum, without a pass of
    its own. Lower precisions add it separately, because the fused sum would skip the rounding of
    the product that Hugging Face's ``residual + linear(x)`` does.
    """
    if weight.packed is not None and x.shape[0] >= weight.min_packed_rows:
        if residual is not None and x.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight.packed, bias, "add")
        out = torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [], "")
    else:
        assert weight.dense is not None, "a weight without its plain copy is always packed"
        out = F.linear(x, weight.dense, bias)
    return out if residual is None else residual + out
