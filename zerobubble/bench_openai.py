"""The ``openai`` backend of ``zerobubble bench``: the same rows against any OpenAI-compatible server.

Rows with ``messages`` go to ``/v1/chat/completions``, rows with ``prompt`` to ``/v1/completions``,
always streamed (SSE) with ``stream_options.include_usage`` so TTFT and inter-token gaps are
measured on the client exactly as for gRPC, and the output token count is the server's usage
figure. A server that sends no usage is counted one token per content chunk (llama.cpp and vLLM
stream one token per chunk without speculation). A row's prediction is sent as OpenAI's
``prediction`` and its accepted and rejected tokens read from ``usage.completion_tokens_details``
(None where the server leaves them out). Server-side figures (acceptance, worker idle) do not
exist over this API and are reported as n/a.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import httpx

from zerobubble.bench import BenchRow, drive, summarize
from zerobubble.client import Completion

logger = logging.getLogger(__name__)

# OpenAI's words -> ours (the report's finish_reasons are comparable across backends).
FINISH_REASONS = {"stop": "eos", "length": "max_tokens", "abort": "cancelled"}


class OpenAIBackendError(RuntimeError):
    """The server could not be used at all (unreachable, no model); single requests that fail
    are recorded as ``error`` completions instead."""


def request_body(row: BenchRow, model: str) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) for one row; greedy unless the row says otherwise, with the row's
    prediction in OpenAI's shape (``{"type": "content", "content": ...}``)."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": row.max_tokens,
        "temperature": row.temperature if row.temperature is not None else 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if row.seed is not None:
        body["seed"] = row.seed
    if row.ignore_eos:
        body["ignore_eos"] = True  # a vLLM extra; llama-server and ours accept it too
    if row.prediction is not None:
        body["prediction"] = {"type": "content", "content": row.prediction}
    if row.schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "row", "schema": row.schema}}
    if row.messages is not None:
        return "/chat/completions", {**body, "messages": row.messages}
    return "/completions", {**body, "prompt": row.prompt}


async def stream_completion(client: httpx.AsyncClient, row: BenchRow, model: str) -> Completion:
    """Send one row and time its SSE stream; failures become ``error`` completions."""
    path, body = request_body(row, model)
    completion = Completion()
    started = time.perf_counter()
    last_token_at: float | None = None
    parts: list[str] = []
    num_chunks = 0
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise OpenAIRequestError(f"HTTP {response.status_code}: {_error_message(response)}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise OpenAIRequestError(str(chunk["error"].get("message", chunk["error"])))
                if chunk.get("usage"):
                    read_usage(chunk["usage"], completion)
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    if text:
                        now = time.perf_counter()
                        if last_token_at is None:
                            completion.ttft_s = now - started
                        else:
                            completion.itl.append(now - last_token_at)
                        last_token_at = now
                        parts.append(text)
                        num_chunks += 1
                    if choice.get("finish_reason"):
                        reason = choice["finish_reason"]
                        completion.finish_reason = FINISH_REASONS.get(reason, reason)
    except (httpx.HTTPError, OpenAIRequestError, json.JSONDecodeError) as exc:
        logger.warning("request %d failed: %s", row.index, exc)
        completion.finish_reason, completion.error = "error", str(exc) or type(exc).__name__
    completion.e2e_s = time.perf_counter() - started
    completion.text = "".join(parts)
    if not completion.num_output_tokens:
        completion.num_output_tokens = num_chunks
    return completion


def read_usage(usage: dict[str, Any], completion: Completion) -> None:
    """Token counts from a ``usage`` object; the prediction counts stay None where the server
    gives no ``completion_tokens_details`` (or none of them in it)."""
    completion.num_prompt_tokens = usage.get("prompt_tokens", 0)
    completion.num_output_tokens = usage.get("completion_tokens", 0)
    details = usage.get("completion_tokens_details") or {}
    completion.num_accepted_prediction_tokens = details.get("accepted_prediction_tokens")
    completion.num_rejected_prediction_tokens = details.get("rejected_prediction_tokens")


class OpenAIRequestError(RuntimeError):
    """One request failed (HTTP error status or an error event in the stream)."""


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


async def served_model(client: httpx.AsyncClient) -> str:
    """The first model ``/v1/models`` lists."""
    try:
        response = await client.get("/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise OpenAIBackendError(f"cannot list models at {client.base_url}models: {exc}") from exc


async def run_openai_bench_async(
    base_url: str,
    rows: Sequence[BenchRow],
    concurrency: int,
    *,
    request_rate: float = 0.0,
    model: str = "",
    api_key: str = "",
    progress: bool = False,
    request_timeout: float | None = None,
) -> dict[str, Any]:
    """Run ``rows`` against the OpenAI-compatible server at ``base_url`` (ending in ``/v1``).

    Raises:
        OpenAIBackendError: no model given and ``/v1/models`` cannot be read.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=base_url.rstrip("/") + "/",
        headers=headers,
        limits=limits,
        timeout=httpx.Timeout(request_timeout, connect=10.0),
    ) as client:
        model = model or await served_model(client)
        completions, wall_s = await drive(
            rows,
            lambda row: stream_completion(client, row, model),
            concurrency,
            request_rate=request_rate,
            progress=progress,
        )
    report = summarize(
        rows,
        completions,
        wall_s=wall_s,
        concurrency=concurrency,
        request_rate=request_rate,
        backend="openai",
        model=model,
    )
    report["base_url"] = base_url
    return report
