"""Suffix decoding's host half: continuations of a request's text, made by the scheduler.

SuffixDecoding (Oliaro et al., Snowflake; arctic-inference in vLLM) drafts the most frequent
continuation of the longest suffix of a request's text that occurred before, in the request
itself (its prompt and output) or in recent outputs of all requests, of variable length: it
stops where the continuation's estimated probability falls below a minimum.

Here each token list is indexed by where each of its bigrams ends (`SuffixIndex`), not by a
suffix tree: appending a token costs one dict append, the cost moves to the queries, and the
scheduler queries a request only when the continuation it sent last stopped matching or ran
short (`SuffixDrafter.plan`). A query takes the latest ``max_candidates`` places where the
text's last two tokens occurred (each with a token after it; "latest" by list, then position,
among the last 256 places indexed), extends each match backwards
(up to ``max_match`` tokens), keeps the longest, and walks forward through their
continuations, taking the most frequent next token each time (ties: the latest place's) with
probability ``count(token) / count(places still agreeing)``, multiplied along the way, until
it drops below ``min_prob`` or the continuation reaches ``spec_factor`` times the match's
length (a two-token match earns two tokens, a long quote many). `reference_continuation` is
the same definition, computed by brute force over the same token lists (the tests' oracle).

The worker gets a continuation with the sequence length it follows (its *anchor*) and drafts
from it on the device as it drafts from a client's predicted output
(`worker_svc/proposers/prediction.py`), keeping the part the tokens produced since still
follow: the host never waits for the device, and the device never for the host.

Memory: a request's own index goes with the request; the outputs of all requests share one
index (`SharedOutputs`) of at most ``shared_max_tokens`` tokens, the oldest outputs evicted first.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# A bigram as one int (token ids are below 2**31): hashed faster than a tuple, and not allocated.
Key = int


def bigram(a: int, b: int) -> Key:
    return (a << 32) | b


@dataclass(frozen=True, slots=True)
class SuffixParams:
    """How continuations are found and cut (arctic-inference's defaults where it has them)."""

    max_match: int = 32  # the longest suffix compared (tokens)
    max_tokens: int = 32  # the longest continuation
    min_prob: float = 0.1  # a continuation stops before a token whose probability falls below this
    spec_factor: float = 1.0  # a continuation is at most this many times its match's length
    max_candidates: int = 32  # the latest occurrences of the last two tokens looked at
    max_queries_per_plan: int = 32  # queries one plan may make (the rest wait for the next)
    shared_context: int = 8  # prompt tokens before each output in the shared index (answer starts)
    shared_max_tokens: int = 1 << 17  # the shared index's size; the oldest outputs go first


@dataclass(frozen=True, slots=True)
class Continuation:
    """A continuation found: its tokens, the sum of their probabilities (the expected number
    accepted) and the length of the suffix it continues."""

    token_ids: list[int]
    score: float
    match_len: int


NO_CONTINUATION = Continuation([], 0.0, 0)


class SuffixIndex:
    """Token lists, and where every bigram of them ends.

    ``ends[key]`` holds ``seq << 32 | end`` for each place (in the order indexed), so that the
    whole index is a few dicts of ``array`` objects, which the garbage collector does not
    traverse (a dict and a list per bigram made its full collections take 100 ms and more at
    a hundred thousand tokens). A removed list's places stay until they outnumber the live
    ones, then every array is compacted; queries skip them meanwhile.
    """

    def __init__(self) -> None:
        self.seqs: dict[int, array[int]] = {}
        self.ends: dict[Key, array[int]] = {}
        self.num_tokens = 0
        self._num_stale = 0  # places of removed lists still in ``ends``
        self._next_seq = 0

    def add(self, token_ids: Sequence[int] = ()) -> int:
        """A new token list (its id)."""
        seq = self._next_seq
        self._next_seq += 1
        self.seqs[seq] = array("l")
        self.extend(seq, token_ids)
        return seq

    def extend(self, seq: int, token_ids: Sequence[int]) -> None:
        """Append tokens to list ``seq`` (nothing if it was removed)."""
        tokens = self.seqs.get(seq)
        if tokens is None:
            return
        ends = self.ends
        # Runs for every token of every request: locals, no calls.
        prev = tokens[-1] if tokens else -1
        place = (seq << 32) | len(tokens)
        for token in token_ids:
            if prev >= 0:
                key = (prev << 32) | token
                places = ends.get(key)
                if places is None:
                    ends[key] = array("q", (place,))
                else:
                    places.append(place)
            prev = token
            place += 1
        tokens.extend(token_ids)
        self.num_tokens += len(token_ids)

    def remove(self, seq: int) -> None:
        """Forget token list ``seq`` (its places go at the next compaction)."""
        tokens = self.seqs.pop(seq, None)
        if tokens is None:
            return
        self.num_tokens -= len(tokens)
        self._num_stale += max(len(tokens) - 1, 0)
        if self._num_stale > self.num_tokens:
            self._compact()

    def _compact(self) -> None:
        """Drop the places of removed lists (and the bigrams left without any)."""
        live = self.seqs
        for key in list(self.ends):
            kept = array("q", (p for p in self.ends[key] if (p >> 32) in live))
            if kept:
                self.ends[key] = kept
            else:
                del self.ends[key]
        self._num_stale = 0

    def continuation(self, pattern: Sequence[int], params: SuffixParams, limit: int) -> Continuation:
        """The most frequent continuation (at most ``limit`` tokens) of the longest suffix of
        ``pattern`` that occurs here with a token after it (see the module's docstring)."""
        if len(pattern) < 2 or limit <= 0:
            return NO_CONTINUATION
        places = self.ends.get(bigram(pattern[-2], pattern[-1]))
        if not places:
            return NO_CONTINUATION
        match_len, found = self._longest_matches(places, pattern, params)
        if not found:
            return NO_CONTINUATION
        tokens, score = _walk(found, min(limit, int(match_len * params.spec_factor)), params.min_prob)
        return Continuation(tokens, score, match_len)

    @staticmethod
    def _latest(places: array[int], window: int) -> list[int]:
        """The last ``window`` places indexed, latest (highest list id, then position) first:
        a bigram as common as a comma is not sorted whole for every query."""
        return sorted(places[-window:] if len(places) > window else places, reverse=True)

    def _longest_matches(
        self, places: array[int], pattern: Sequence[int], params: SuffixParams
    ) -> tuple[int, list[tuple[array[int], int]]]:
        """The longest match among the latest candidates, and its places (latest first)."""
        n = len(pattern)
        best, found, seen = 0, [], 0
        seqs = self.seqs
        for place in self._latest(places, max(256, 8 * params.max_candidates)):
            tokens = seqs.get(place >> 32)
            end = place & 0xFFFFFFFF
            if tokens is None or end >= len(tokens) - 1:
                continue  # a removed list, or nothing follows it
            most = min(n, end + 1, params.max_match)
            m = 2
            while m < most and tokens[end - m] == pattern[n - 1 - m]:
                m += 1
            if m > best:
                best, found = m, [(tokens, end)]
            elif m == best:
                found.append((tokens, end))
            seen += 1
            if seen >= params.max_candidates:
                break
        return best, found


def _walk(places: list[tuple[array[int], int]], limit: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent path forward from ``places`` (token list, end index), cut where its
    probability drops below ``min_prob``; returns the tokens and their summed probabilities.

    Places whose next ``limit`` tokens are the same walk as one weighted path (text repeated
    across requests makes many), in the order of their latest place, which breaks ties."""
    paths = list(Counter(tuple(tokens[end + 1 : end + 1 + limit]) for tokens, end in places).items())
    agreeing = len(places)
    out: list[int] = []
    prob, score = 1.0, 0.0
    while len(out) < limit:
        d = len(out)
        if len(paths) == 1:
            # One path left: every further token has the same probability.
            more = list(paths[0][0][d:])
            return out + more, score + prob * len(more)
        counts: dict[int, int] = {}
        for path, n in paths:
            if d < len(path):
                counts[path[d]] = counts.get(path[d], 0) + n
        if not counts:
            break
        token = max(counts, key=counts.__getitem__)  # ties: the first seen, the latest place's
        prob *= counts[token] / agreeing
        if prob < min_prob:
            break
        out.append(token)
        score += prob
        agreeing = counts[token]
        paths = [(path, n) for path, n in paths if d < len(path) and path[d] == token]
    return out, score


def reference_continuation(
    seqs: Mapping[int, Sequence[int]], pattern: Sequence[int], params: SuffixParams, limit: int
) -> Continuation:
    """`SuffixIndex.continuation` by brute force over every position of every list: the
    definition the index must compute (tests compare them)."""
    if len(pattern) < 2 or limit <= 0:
        return NO_CONTINUATION
    lists: dict[int, list[int]] = {seq: list(tokens) for seq, tokens in seqs.items()}
    candidates = [
        (lists[seq], end)
        for seq in sorted(lists, reverse=True)
        for end in range(len(lists[seq]) - 2, 0, -1)
        if lists[seq][end - 1 : end + 1] == list(pattern[-2:])
    ][: params.max_candidates]

    def match_len(tokens: list[int], end: int) -> int:
        most = min(len(pattern), end + 1, params.max_match)
        return max(m for m in range(2, most + 1) if tokens[end - m + 1 : end + 1] == list(pattern[len(pattern) - m :]))

    if not candidates:
        return NO_CONTINUATION
    best = max(match_len(t, e) for t, e in candidates)
    places = [(t, e) for t, e in candidates if match_len(t, e) == best]
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while len(draft) < min(limit, int(best * params.spec_factor)):
        agreeing = [(t, e) for t, e in places if t[e + 1 : e + 1 + len(draft)] == draft]
        following = Counter(t[e + 1 + len(draft)] for t, e in agreeing if e + 1 + len(draft) < len(t))
        if not following:
            break
        token, count = following.most_common(1)[0]
        prob *= count / len(agreeing)
        if prob < params.min_prob:
            break
        draft.append(token)
        score += prob
    return Continuation(draft, score, best)


class SharedOutputs:
    """The outputs of every request of a scheduler (or of all, when shared), each after the
    last few tokens of its prompt, in one index of bounded size: the oldest outputs (finished
    or not) are evicted first, and a request's later tokens then go nowhere."""

    def __init__(self, params: SuffixParams = SuffixParams()) -> None:
        self.params = params
        self.index = SuffixIndex()

    def start(self, prompt_tail: Sequence[int]) -> int:
        """A new output, after ``prompt_tail``; its id."""
        seq = self.index.add(prompt_tail)
        self._evict()
        return seq

    def extend(self, seq: int, token_ids: Sequence[int]) -> None:
        self.index.extend(seq, token_ids)
        self._evict()

    def _evict(self) -> None:
        index = self.index
        while index.num_tokens > self.params.shared_max_tokens and index.seqs:
            index.remove(next(iter(index.seqs)))


@dataclass(slots=True)
class SuffixState:
    """One request's suffix-decoding state (kept on its `Request`, so it moves with it).

    ``own`` indexes its prompt and confirmed outputs (list 0); ``sent`` is the continuation
    the worker holds, anchored after the first ``anchor`` tokens (emptied at every admission:
    the worker's slot starts without one)."""

    own: SuffixIndex = field(default_factory=SuffixIndex)
    shared: SharedOutputs | None = None  # the shared index ``shared_seq`` is in
    shared_seq: int = -1
    num_indexed: int = 0  # tokens (prompt + outputs) in ``own``
    num_shared: int = 0  # outputs in the shared index
    sent: list[int] = field(default_factory=list)
    anchor: int = 0
    query_after: int = 0  # known tokens from which the next query may run
    backoff: int = 1  # tokens to wait after a query that found nothing (doubles, up to 16)


class Request(Protocol):
    """What the drafter reads of a request (`scheduler_svc.request.Request`, which imports us)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_placeholders: int
    suffix: SuffixState | None

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    def token_ids_between(self, start: int, stop: int) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class SuffixPlan:
    """What a decode row gets: its draft slots, and a continuation to send (None: keep the
    worker's) anchored after ``anchor`` tokens."""

    num_draft_slots: int
    send: list[int] | None = None
    anchor: int = 0


class SuffixDrafter:
    """A scheduler's suffix decoding: each decode row's draft slots, and when the worker needs
    a new continuation for it.

    A request's continuation is replaced only when the confirmed output stopped following it
    or too little of it is left for the next step (what the steps in flight will consume
    counted as accepted); at most ``max_queries_per_plan`` queries per plan, the requests
    refused one in the previous plan served first (rows are planned in running order, which
    would otherwise let the first ones take the budget every time), and none for a request
    whose text has not grown since its last query, or by fewer tokens than its back-off after
    queries that found nothing.
    """

    def __init__(
        self,
        budget: int,
        shared: SharedOutputs | None = None,
        params: SuffixParams | None = None,
        sent_lengths: list[int] | None = None,
    ) -> None:
        """``budget``: the most draft slots a row may carry (the worker's `num_prediction_tokens`);
        ``sent_lengths``: where to count the continuations sent, by length (index = tokens; 0:
        a continuation cleared)."""
        self.params = params or (shared.params if shared is not None else SuffixParams())
        self.shared = shared if shared is not None else SharedOutputs(self.params)
        self.budget = budget
        self.queries_left = self.params.max_queries_per_plan
        self.num_queries = 0
        self.sent_lengths: list[int] = sent_lengths if sent_lengths is not None else []
        # Requests refused a query for want of budget, in the order refused (by their state's
        # id), and those of them whose turn this plan is (their queries are kept for them).
        self._waiting: dict[int, None] = {}
        self._turns: set[int] = set()

    def new_plan(self) -> None:
        """A plan starts: its query budget is whole again, kept first for the requests refused
        one longest ago (a turn not taken, by a request done or no longer asking, is lost)."""
        for key in self._turns:
            self._waiting.pop(key, None)
        self.queries_left = self.params.max_queries_per_plan
        self._turns = set(list(self._waiting)[: self.queries_left])

    def _may_query(self, state: SuffixState) -> bool:
        """Whether the plan's query budget has room for ``state``'s request (counted if so)."""
        key = id(state)
        if key in self._turns:
            self._turns.discard(key)
            self._waiting.pop(key, None)
        elif self.queries_left <= len(self._turns):
            self._waiting.setdefault(key, None)
            return False
        self.queries_left -= 1
        self.num_queries += 1
        return True

    def plan(self, req: Request, num_spec_tokens: int) -> SuffixPlan:
        """The draft slots of ``req``'s next decode (at least ``num_spec_tokens``, for the
        worker's prompt lookup where no continuation applies) and the continuation to send,
        if any. Nothing changes until `commit`."""
        state = self._state(req)
        known, in_flight = req.num_tokens, req.num_placeholders
        rest = self._rest(req, state)
        # Enough left for the next step, counting what the steps in flight consume if accepted.
        if rest is not None and len(rest) - in_flight >= max(num_spec_tokens, 1):
            return SuffixPlan(self._slots(rest, in_flight, num_spec_tokens))
        if known < state.query_after or not self._may_query(state):
            return SuffixPlan(self._slots(rest or [], in_flight, num_spec_tokens))
        new = self._query(req).token_ids
        # Nothing found: the text must grow before a match can appear, so wait longer each time.
        state.backoff = 1 if new else min(2 * state.backoff, 16)
        state.query_after = known + state.backoff
        if rest is not None and rest[: len(new)] == new:
            return SuffixPlan(self._slots(rest, in_flight, num_spec_tokens))  # nothing better
        if not new and rest is None and not state.sent:
            return SuffixPlan(self._slots([], 0, num_spec_tokens))  # the worker holds none already
        return SuffixPlan(self._slots(new, in_flight, num_spec_tokens), new, known)

    def commit(self, req: Request, plan: SuffixPlan) -> None:
        """``plan``'s continuation went out in a plan for ``req``."""
        if plan.send is None or req.suffix is None:
            return
        state = req.suffix
        state.sent, state.anchor = plan.send, plan.anchor
        n = len(plan.send)
        if n >= len(self.sent_lengths):
            self.sent_lengths.extend([0] * (n + 1 - len(self.sent_lengths)))
        self.sent_lengths[n] += 1

    @staticmethod
    def admitted(req: Request) -> None:
        """``req`` was (re)admitted: its new slot on the worker holds no continuation."""
        if req.suffix is not None:
            req.suffix.sent = []

    def finish(self, req: Request) -> None:
        """``req`` is done: its whole output goes to the shared index, its own index is freed."""
        if req.suffix is not None:
            self._catch_up(req, req.suffix)
            req.suffix = None

    def _slots(self, continuation: list[int], in_flight: int, num_spec_tokens: int) -> int:
        return min(self.budget, max(num_spec_tokens, len(continuation) - in_flight))

    def _rest(self, req: Request, state: SuffixState) -> list[int] | None:
        """What the worker's continuation holds after the known tokens, if the confirmed
        output follows it (None: it holds none, or the output left it)."""
        if not state.sent:
            return None
        done = req.num_tokens - state.anchor
        if done > len(state.sent) or req.token_ids_between(state.anchor, req.num_tokens) != state.sent[:done]:
            return None
        return state.sent[done:]

    def _query(self, req: Request) -> Continuation:
        """The better continuation (higher score; ties: the request's own) of the request's
        own text and of all outputs."""
        known = req.num_tokens
        params = self.params
        pattern = req.token_ids_between(max(0, known - params.max_match), known)
        assert req.suffix is not None
        own = req.suffix.own.continuation(pattern, params, params.max_tokens)
        shared = self.shared.index.continuation(pattern, params, params.max_tokens)
        return shared if shared.score > own.score else own

    def _state(self, req: Request) -> SuffixState:
        """``req``'s state, made on its first decode, with every known token indexed."""
        state = req.suffix
        if state is None:
            state = req.suffix = SuffixState()
            state.own.add(req.prompt_token_ids)
            state.num_indexed = req.num_prompt_tokens
        self._catch_up(req, state)
        return state

    def _catch_up(self, req: Request, state: SuffixState) -> None:
        """Index the tokens confirmed since the last call, in the request's own index and in
        the shared one (where a request moved from another scheduler starts a new output)."""
        known = req.num_tokens
        if state.num_indexed < known:
            state.own.extend(0, req.token_ids_between(state.num_indexed, known))
            state.num_indexed = known
        if state.shared is not self.shared:
            state.shared = self.shared
            state.shared_seq = self.shared.start(req.prompt_token_ids[-self.params.shared_context :])
            state.num_shared = 0
        outputs = req.output_token_ids
        if state.num_shared < len(outputs):
            self.shared.extend(state.shared_seq, outputs[state.num_shared :])
            state.num_shared = len(outputs)
