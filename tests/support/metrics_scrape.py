"""Read a service's /metrics the way Prometheus would (prometheus_client's parser)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.support.polling import wait_until


def scrape(port: int) -> list:
    """Every sample of one /metrics scrape (prometheus_client's parser: name, labels, value)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list, name: str, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def metric(port: int, name: str, **labels) -> float:
    """`total` of one fresh scrape of the service on `port`."""
    return total(scrape(port), name, **labels)


def wait_all_released(port: int, timeout: float = 30.0) -> None:
    """Until the scheduler on metrics `port` runs no request and holds no KV block (a cancelled
    stream's request is aborted a moment after the client leaves)."""

    def released() -> bool:
        samples = scrape(port)
        return (
            total(samples, "zerobubble_kv_cache_usage_ratio") == 0.0
            and total(samples, "zerobubble_num_requests_running") == 0
        )

    wait_until(released, timeout, "every request to end and its KV blocks to be freed", poll=0.2)
