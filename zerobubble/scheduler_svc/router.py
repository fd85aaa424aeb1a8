"""Routing over several workers (data-parallel replicas, each with its own block pool).

New requests go to the ready worker with the best prefix-cache affinity, then the lightest load,
among the workers that are not much busier than the least-loaded one.
`dns:///name:port` targets (a headless Service) are re-resolved so pods that come and go are
picked up. When a worker is lost, its unfinished requests move to the others and resume from
their confirmed tokens, so client streams go on with no lost or repeated tokens.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from zerobubble.request_options import SamplingOptions, StoppingOptions
from zerobubble.scheduler_svc.scheduler import RequestEvent, SchedulerConfig, fail_unplaced
from zerobubble.scheduler_svc.suffix import SharedOutputs
from zerobubble.scheduler_svc.worker_link import DEFAULT_LOOKAHEAD_MARGIN_S, WorkerLink

logger = logging.getLogger(__name__)

DNS_PREFIX = "dns:///"
DNS_REFRESH_S = 10.0
# A prefix-cache hit saves prefill work, but not at any price: a worker holding more than this
# many requests above the least-loaded one is passed over for affinity. Without the bound, a
# prefix every request shares (a chat template's system prompt) pins all traffic to the first
# worker that cached it while the others idle.
AFFINITY_MAX_EXTRA_LOAD = 2


def resolve_targets(targets: list[str]) -> dict[str, str | None]:
    """Expand `dns:///name:port` entries to one `ip:port` per address record.

    Maps each address to the name its TLS certificate is checked against: `name` for an address
    resolved from `dns:///name:port` (a certificate names the Service, never a pod IP), None
    for a target given as is (gRPC then checks its own host part).
    """
    out: dict[str, str | None] = {}
    for target in targets:
        if not target.startswith(DNS_PREFIX):
            out.setdefault(target, None)
            continue
        host, _, port = target[len(DNS_PREFIX) :].rpartition(":")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            logger.warning("cannot resolve %s: %s", target, exc)
            continue
        for family, _, _, _, addr in infos:
            host_ip = str(addr[0])
            ip = f"[{host_ip}]" if family == socket.AF_INET6 else host_ip
            out.setdefault(f"{ip}:{addr[1]!s}", host)
    return out


@dataclass(frozen=True, slots=True)
class LinkSettings:
    """How the router connects each worker link it adds (see `WorkerLink`)."""

    max_inflight_steps: int
    creds: grpc.ChannelCredentials | None = None
    auth_token: str = ""
    step_deadline_s: float = 0.0
    lookahead_margin_s: float | None = DEFAULT_LOOKAHEAD_MARGIN_S


class Router:
    """Owns the worker links and which link each request lives on."""

    def __init__(
        self,
        config: SchedulerConfig,
        max_inflight_steps: int,
        creds: grpc.ChannelCredentials | None = None,
        metrics=None,
        worker_auth_token: str = "",
        step_deadline_s: float = 0.0,
        lookahead_margin_s: float | None = DEFAULT_LOOKAHEAD_MARGIN_S,
    ) -> None:
        self.config = config
        self.link_settings = LinkSettings(
            max_inflight_steps, creds, worker_auth_token, step_deadline_s, lookahead_margin_s
        )
        self.metrics = metrics
        self.links: list[WorkerLink] = []
        self.owner: dict[str, WorkerLink] = {}  # req_id -> link holding it
        self.orphans: list = []  # requests waiting for any worker
        self.on_events: Callable[[WorkerLink, list[RequestEvent]], None] = lambda link, ev: None
        self.on_readiness: Callable[[bool], Awaitable[None]] | None = None
        self._targets: list[str] = []
        self._refresh_task: asyncio.Task | None = None
        self._serving = False
        self._exported: dict[str, tuple] = {}
        # Suffix decoding: the outputs of every worker's requests, drafted from by all of them.
        self.suffix_outputs = SharedOutputs()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self, targets: list[str]) -> None:
        self._targets = targets
        self._sync_links(resolve_targets(targets))
        if any(t.startswith(DNS_PREFIX) for t in targets):
            self._refresh_task = asyncio.create_task(self._refresh_loop())

    async def close(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
        for link in self.links:
            await link.close()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(DNS_REFRESH_S)
            addresses = await asyncio.to_thread(resolve_targets, self._targets)
            if addresses:  # a failed lookup keeps the links we have
                self._sync_links(addresses)

    def _sync_links(self, addresses: dict[str, str | None]) -> None:
        current = {link.address: link for link in self.links}
        for address, server_name in addresses.items():
            if address not in current:
                settings = self.link_settings
                link = WorkerLink(
                    address,
                    self.config,
                    settings.max_inflight_steps,
                    self._on_link_events,
                    self._on_link_lost,
                    settings.creds,
                    self._on_step,
                    self.link_ready,
                    server_name=server_name,
                    auth_token=settings.auth_token,
                    step_deadline_s=settings.step_deadline_s,
                    lookahead_margin_s=settings.lookahead_margin_s,
                )
                link.callbacks.on_draining = self._on_link_draining
                link.suffix_outputs = self.suffix_outputs
                self.links.append(link)
                link.start()
                logger.info("added worker %s", address)
        for address, link in current.items():
            if address not in addresses:
                logger.info("worker %s left the target set", address)
                self.links.remove(link)
                if self.metrics is not None:
                    self.metrics.forget_worker(link.worker_id)
                self._on_link_lost(link)
                asyncio.create_task(link.close())

    # -- readiness -----------------------------------------------------------------------------

    def ready_links(self) -> list[WorkerLink]:
        return [link for link in self.links if link.ready and not link.draining]

    def any_ready(self) -> WorkerLink | None:
        ready = self.ready_links()
        return ready[0] if ready else None

    def _update_readiness(self) -> None:
        serving = bool(self.ready_links())
        if serving != self._serving and self.on_readiness is not None:
            self._serving = serving
            asyncio.ensure_future(self.on_readiness(serving))
        if serving and self.orphans:
            orphans, self.orphans = self.orphans, []
            for request in orphans:
                self._place(request)

    # -- requests ------------------------------------------------------------------------------

    def route(self, prompt_ids: list[int]) -> WorkerLink | None:
        """Among the ready links whose load is within `AFFINITY_MAX_EXTRA_LOAD` of the lightest,
        the one with the most cached prefix blocks, then the lightest load."""
        ready = self.ready_links()
        if not ready:
            return None
        least = min(link.load() for link in ready)
        candidates = [link for link in ready if link.load() <= least + AFFINITY_MAX_EXTRA_LOAD]
        if len(candidates) == 1:  # nothing to weigh: skip hashing the prompt's blocks
            return candidates[0]
        return max(candidates, key=lambda link: (link.sched.cached_prefix_blocks(prompt_ids), -link.load()))

    def submit(
        self,
        link: WorkerLink,
        req_id: str,
        prompt_ids: list[int],
        sampling: SamplingOptions,
        stopping: StoppingOptions,
        *,
        share_prompt_with: str | None = None,
        detokenize: bool = True,
    ) -> None:
        """Queue a request on ``link``'s scheduler (see `Scheduler.add_request`) and remember
        that it holds it."""
        link.sched.add_request(
            req_id, prompt_ids, sampling, stopping, share_prompt_with=share_prompt_with, detokenize=detokenize
        )
        self.owner[req_id] = link
        link.note_arrival()

    def abort(self, req_id: str) -> RequestEvent | None:
        """Cancel a request wherever it is; its final event (None if no worker held it)."""
        link = self.owner.pop(req_id, None)
        self.orphans = [r for r in self.orphans if r.req_id != req_id]
        event = None
        if link is not None and link.scheduler is not None:
            event = link.scheduler.abort_request(req_id)
            link.wake()
            if self.metrics is not None:  # its blocks are free now, not at the next result
                self._export_gauges()
        return event

    def _place(self, request, lost: WorkerLink | None = None) -> None:
        """Queue a moved request on the best ready link (or keep it until one is ready).

        One that no ready worker can take (longer than its model length) ends with ERROR and a
        message right away: a client must never wait for a placement that cannot happen.
        """
        link = self.route(request.all_token_ids())
        if link is None:
            self.orphans.append(request)
            return
        try:
            link.sched.adopt(request)
        except ValueError as exc:
            logger.error("cannot move request %s to worker %s: %s", request.req_id, link.worker_id, exc)
            self.owner.pop(request.req_id, None)
            self.on_events(
                lost or link, [fail_unplaced(request, f"its worker was lost and it cannot be resumed elsewhere: {exc}")]
            )
            return
        self.owner[request.req_id] = link
        link.wake()

    # -- link callbacks ------------------------------------------------------------------------

    def _on_link_events(self, link: WorkerLink, events: list[RequestEvent]) -> None:
        for ev in events:
            if ev.finish_reason is not None:
                self.owner.pop(ev.req_id, None)
        self.on_events(link, events)
        if self.metrics is not None and link.scheduler is not None:
            self._export_gauges()

    def _on_step(self, link: WorkerLink, result) -> None:
        if self.metrics is None:
            return
        # Scheduler counters are cumulative per scheduler instance; export the increments.
        # Speculation figures come from the scheduler too, not from the raw result: it counts
        # only rows it applied (not those of preempted, aborted or finished requests).
        sched = link.sched
        s, pc = sched.stats, sched.prefix_cache_counters
        spec, pred = s.spec, s.prediction
        now = (
            s.num_rolled_back_tokens,
            s.num_preemptions,
            pc.num_query_tokens,
            pc.num_hit_tokens,
            spec.num_drafts,
            spec.num_draft_tokens,
            spec.num_accepted_tokens,
            pred.num_draft_tokens,
            pred.num_accepted_tokens,
            tuple(spec.accepted_per_pos),
            tuple(spec.suffix_continuations),
            tuple(spec.draft_lengths),
        )
        # Keyed by link and checked by identity: a reconnect builds a new scheduler whose
        # counters start from zero (an id() could be reused and give negative increments).
        zero = (0, 0, 0, 0, 0, 0, 0, 0, 0, (), (), ())
        seen_sched, last = self._exported.get(link.address, (None, zero))
        if seen_sched is not sched:
            last = zero
        self._exported[link.address] = (sched, now)
        per_pos = [n - (last[9][i] if i < len(last[9]) else 0) for i, n in enumerate(now[9])]
        self.metrics.record_step(
            link.worker_id,
            float(result.forward_s),
            float(result.idle_s),
            num_drafts=now[4] - last[4],
            num_draft_tokens=now[5] - last[5],
            num_accepted=now[6] - last[6],
            accepted_per_pos=per_pos,
            num_prediction_draft_tokens=now[7] - last[7],
            num_prediction_accepted=now[8] - last[8],
            collective_s=float(result.collective_s),
        )
        if now[10] != last[10]:
            sent = [n - (last[10][i] if i < len(last[10]) else 0) for i, n in enumerate(now[10])]
            self.metrics.add_suffix_continuations(link.worker_id, sent)
        if now[11] != last[11]:
            planned = [n - (last[11][i] if i < len(last[11]) else 0) for i, n in enumerate(now[11])]
            self.metrics.add_draft_slots(link.worker_id, planned)
        self.metrics.set_inflight(link.worker_id, link.inflight)
        self.metrics.add_rolled_back(now[0] - last[0])
        self.metrics.add_preemptions(now[1] - last[1])
        self.metrics.add_prefix_cache(now[2] - last[2], now[3] - last[3])

    def _on_link_lost(self, link: WorkerLink) -> None:
        """Move the lost worker's requests to the others, from their confirmed tokens."""
        if link.scheduler is not None:
            moved = link.scheduler.take_unfinished()
            if moved:
                logger.warning("re-queueing %d requests from lost worker %s", len(moved), link.worker_id)
            for request in moved:
                self.owner.pop(request.req_id, None)
                self._place(request, link)
        self._update_readiness()

    def _on_link_draining(self, link: WorkerLink) -> None:
        """A worker is shutting down: its queued requests go elsewhere, the running finish."""
        if link.scheduler is not None:
            for request in link.scheduler.take_waiting():
                self.owner.pop(request.req_id, None)
                self._place(request, link)
        self._update_readiness()

    def link_ready(self, link: WorkerLink) -> None:
        if self.metrics is not None and link.info is not None:
            self.metrics.set_model(link.info.model)
            self.metrics.add_worker(link.worker_id, link.info.num_spec_tokens)
            self.metrics.set_tensor_parallel_size(link.worker_id, link.info.tensor_parallel_size)
        self._update_readiness()

    def _export_gauges(self) -> None:
        running = waiting = 0
        for link in self.links:
            if link.scheduler is None:
                continue
            running += link.scheduler.num_running()
            waiting += link.scheduler.num_waiting()
            self.metrics.set_kv_usage(link.worker_id, link.scheduler.kv_usage())
            self.metrics.set_inflight(link.worker_id, link.inflight)
        waiting += len(self.orphans)
        self.metrics.set_queues(running, waiting)
