"""Replica state: active /health probes, passive failure tracking, a circuit breaker, engine /metrics scraping.

Each `ReplicaState` has a breaker fed by both paths — the proxy reports failures that are the replica's own
(`record_failure`) and successes (`record_success`), and the prober does the same for every /health probe.
`breaker_failures` consecutive failures open the breaker for `breaker_backoff_s`, doubling on every re-open up
to `breaker_backoff_max_s`; once the back-off has passed the replica is half-open: routable for one trial
request at a time (`begin_attempt`), whose success closes the breaker and whose failure re-opens it with a
longer back-off, so a replica coming back is not flooded before it has proven itself; a probe is a trial
too. The clock is a parameter so tests move time by hand.

Whose failure is it? A breaker must only count what is the replica's fault, or one hostile client opens them all:
* connect errors, a body or stream that breaks, a streaming request answered without SSE, a redirect (never
  followed), a failed /health probe (including a 3xx or a body past `max_scrape_bytes`): the replica's, counted
  at once.
* a 5xx answer to a completion: undecided when it happens. The proxy retries elsewhere; if another replica then
  answers the same request without a 5xx, the first answer was the replica's and is counted; if a second replica
  also answers it 5xx, the request is the cause (poison input) and neither is counted
  (`kvrouter_upstream_rejections_total{reason="request_5xx"}`); a request that fails on every replica fails
  alone, with the last answer. A replica that 5xxs only some requests while serving others keeps its breaker
  closed, since every success resets the consecutive count. Pass-through 5xx answers are relayed, never counted.
* 429 is overload, not ill health, and is never counted.
* a stall: no first byte within `first_byte_timeout_s` while the replica showed no progress on any request
  (no answer headers, no stream chunk, no rise of the engine's token counters in a scrape). That opens the
  breaker at once and marks it stalled. A replica that is merely slow (queued prefills while it decodes others)
  shows progress and is waited for.
Failures a probe cannot see — stalls and 5xx answers charged to the replica — are "probe-blind": a passing /health
probe neither resets their count nor closes the breaker they opened (a hung or broken engine behind a live HTTP
server still says 200); only a real request that succeeds there, the half-open trial, does. Connect errors and
failed probes stay closable by a passing probe, so a restarted replica comes back as soon as it answers /health.

`ReplicaSet.run_probes` and `ReplicaSet.run_scrapes` are the background loops (started from the app factory's
cleanup context). The scrape reads vLLM's Prometheus text once per `metrics_interval_s` and feeds
`LoadBook.observe_engine` with waiting and running requests summed over the `engine` label (a data-parallel
replica reports one series per engine) and KV-cache usage averaged over engines (it is a fraction per engine),
and `on_engine_totals` (when set) with the prefill histograms' totals (kv_aware's engine-side rate bound).
Probe and scrape bodies are read incrementally up to `max_scrape_bytes` and redirects are never followed.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import aiohttp

from kvrouter.config import FleetConfig, ReplicaConfig, Settings
from kvrouter.metrics import RouterMetrics
from kvrouter.routing.engine_rates import EngineTotals, Fallback, parse_engine_totals
from kvrouter.routing.load import EngineGauges, LoadBook
from kvrouter.routing.router import Route
from kvrouter.server.streaming import BodyTooLarge, read_capped
from kvrouter.typedefs import ReplicaName

log = logging.getLogger(__name__)


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    failures: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0


class ReplicaState:
    """One replica: its configuration, its breaker and what the last probe saw."""

    def __init__(
        self,
        config: ReplicaConfig,
        block_size: int,
        breaker: BreakerPolicy,
        clock: Callable[[], float],
        lora_adapters: frozenset[str] | None = None,
    ) -> None:
        self.config = config
        self.name: ReplicaName = config.replica
        self.base_url = config.base_url
        adapters = frozenset(config.lora_adapters) if lora_adapters is None else lora_adapters
        self.route = Route(self.name, block_size, config.weight, adapters, config.role)
        self._breaker = breaker
        self._clock = clock
        self.consecutive_failures = 0
        self.opens = 0
        self.open_until = 0.0
        self._open = False
        self._trial = False
        self.last_error: str | None = None
        self.last_probe_ok: bool | None = None
        self.stalled = False
        """The last request-path failure was a stall (no first byte, no progress)."""
        self.probe_blind = False
        """A failure a probe cannot see (a stall, a 5xx to requests) is counted: only a request's success clears
        it and closes the breaker, never a passing /health probe."""
        self.progress_at = clock()
        """When the replica last showed progress: answer headers, a body chunk, or rising engine token counters."""
        self.engine_tokens: float | None = None

    @property
    def state(self) -> BreakerState:
        if not self._open:
            return BreakerState.CLOSED
        return BreakerState.OPEN if self._clock() < self.open_until else BreakerState.HALF_OPEN

    @property
    def routable(self) -> bool:
        return not self._open or (not self._trial and self._clock() >= self.open_until)

    def begin_attempt(self) -> None:
        """A request is being sent here; when half-open it is the trial and others wait for its verdict."""
        if self._open:
            self._trial = True

    def end_attempt(self) -> None:
        """The attempt ended without a verdict on the replica (the client left): let another trial through."""
        self._trial = False

    def record_success(self, *, probe: bool = False) -> None:
        """A success; a probe's does not close a stalled breaker (the HTTP server may answer while the engine hangs)."""
        if probe and self.probe_blind:
            return
        self.consecutive_failures = 0
        self._trial = False
        self.stalled = False
        self.probe_blind = False
        if self._open:
            self._open = False
            self.opens = 0
            log.info("replica %s recovered; breaker closed", self.name)

    def record_progress(self) -> None:
        self.progress_at = self._clock()

    def record_stall(self, reason: str) -> bool:
        """The replica took a request and showed no progress at all for a whole window: open the breaker now."""
        self.stalled = True
        self.consecutive_failures = max(self.consecutive_failures, self._breaker.failures - 1)
        return self.record_failure(reason, probe_blind=True)

    def record_failure(self, reason: str, *, probe_blind: bool = False) -> bool:
        """Count one failure; True when this failure opened (or re-opened) the breaker."""
        self.last_error = reason
        self.probe_blind = self.probe_blind or probe_blind
        self.consecutive_failures += 1
        self._trial = False
        half_open = self._open and self._clock() >= self.open_until
        if half_open or (not self._open and self.consecutive_failures >= self._breaker.failures):
            self.opens += 1
            backoff = min(self._breaker.backoff_s * 2 ** (self.opens - 1), self._breaker.backoff_max_s)
            self._open = True
            self.open_until = self._clock() + backoff
            log.warning("replica %s breaker open for %.1fs after: %s", self.name, backoff, reason)
            return True
        return False

    def describe(self) -> dict[str, object]:
        state = self.state
        return {
            "url": self.base_url,
            "state": state.value,
            "routable": self.routable,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
            "last_probe_ok": self.last_probe_ok,
            "stalled": self.stalled,
            "retry_in_s": round(max(0.0, self.open_until - self._clock()), 3) if state is BreakerState.OPEN else 0,
        }


class ReplicaSet:
    """The fleet as the proxy sees it; the order is replicas.yaml's."""

    def __init__(
        self,
        fleet: FleetConfig,
        settings: Settings,
        load: LoadBook,
        metrics: RouterMetrics,
        clock: Callable[[], float],
    ) -> None:
        breaker = BreakerPolicy(settings.breaker_failures, settings.breaker_backoff_s, settings.breaker_backoff_max_s)
        self.replicas = [
            ReplicaState(r, fleet.block_size_of(r), breaker, clock, fleet.adapters_of(r)) for r in fleet.replicas
        ]
        self.by_name = {r.name: r for r in self.replicas}
        self._settings = settings
        self._load = load
        self._metrics = metrics
        self._pass_turn = 0
        self._breaker = breaker
        self._clock = clock
        self.draining: set[ReplicaName] = set()
        """Drained by an operator (kvrouter.admin.api): healthy, but no new request goes there."""
        self.on_gone: Callable[[ReplicaName], None] | None = None
        """Called when a replica refuses a connection: nothing listens at its address, so its process and the
        KV cache it held are gone (the app drops the replica's prefix-index entries)."""
        self.on_engine_totals: Callable[[ReplicaName, EngineTotals | Fallback], None] | None = None
        """Called with every scraped /metrics body's prefill totals, or why there are none (kv_aware's engine
        source, `kvrouter.server.engine_costs`)."""

    def __iter__(self) -> Iterator[ReplicaState]:
        return iter(self.replicas)

    def routable(self, exclude: Sequence[ReplicaName] = ()) -> list[ReplicaState]:
        return [r for r in self.replicas if r.name not in exclude and r.routable and r.name not in self.draining]

    def add(self, config: ReplicaConfig, block_size: int, lora_adapters: frozenset[str] | None = None) -> ReplicaState:
        """A replica joins (live reload). The list is replaced, never mutated, so running loops keep theirs."""
        state = ReplicaState(config, block_size, self._breaker, self._clock, lora_adapters)
        self.replicas = [*(r for r in self.replicas if r.name != state.name), state]
        self.by_name = {**self.by_name, state.name: state}
        return state

    def remove(self, name: ReplicaName) -> ReplicaState | None:
        """A replica leaves: no new requests; requests in flight keep the state object they hold and finish."""
        state = self.by_name.get(name)
        if state is None:
            return None
        self.replicas = [r for r in self.replicas if r.name != name]
        self.by_name = {n: r for n, r in self.by_name.items() if n != name}
        self.draining.discard(name)
        return state

    def record_failure(
        self, replica: ReplicaState, reason: str, error: BaseException | None = None, *, probe_blind: bool = False
    ) -> None:
        if replica.record_failure(reason, probe_blind=probe_blind):
            self._metrics.breaker_opens.labels(replica.name).inc()
        if self.on_gone is not None and _refused(error):
            self.on_gone(replica.name)

    def record_stall(self, replica: ReplicaState, reason: str) -> None:
        self.reject(replica, "stalled")
        if replica.record_stall(reason):
            self._metrics.breaker_opens.labels(replica.name).inc()

    def reject(self, replica: ReplicaState, reason: str) -> None:
        """Count an upstream answer refused or re-attributed (kvrouter_upstream_rejections_total)."""
        self._metrics.upstream_rejections.labels(replica.name, reason).inc()

    def for_passthrough(self, exclude: Sequence[ReplicaName] = ()) -> ReplicaState | None:
        """A replica for a path the router does not route (tokenize, ...): the least busy, rotating ties."""
        candidates = self.routable(exclude)
        if not candidates:
            return None
        self._pass_turn += 1
        turn = self._pass_turn
        count = len(candidates)
        return min(
            enumerate(candidates),
            key=lambda pair: (self._load.snapshot(pair[1].name).in_flight, (pair[0] - turn) % count),
        )[1]

    def update_gauges(self) -> None:
        for replica in self.replicas:
            self._metrics.replica_healthy.labels(replica.name).set(1.0 if replica.routable else 0.0)
            self._metrics.in_flight.labels(replica.name).set(self._load.own_in_flight(replica.name))

    async def probe(self, session: aiohttp.ClientSession, replica: ReplicaState) -> bool:
        timeout = aiohttp.ClientTimeout(total=max(self._settings.health_interval_s, 1.0))
        failure: BaseException | None = None
        try:
            url = f"{replica.base_url}/health"
            async with session.get(url, timeout=timeout, allow_redirects=False) as response:
                await read_capped(response, self._settings.max_scrape_bytes)
                ok = response.status == 200
                reason = f"health probe answered {response.status}"
        except BodyTooLarge as error:
            self.reject(replica, "probe_too_large")
            ok, reason = False, f"health probe answered a {error}"
        except (aiohttp.ClientError, TimeoutError) as error:
            ok, reason = False, f"health probe failed: {type(error).__name__}: {error}"
            failure = error
        replica.last_probe_ok = ok
        if ok:
            replica.record_success(probe=True)
        else:
            self._metrics.probe_failures.labels(replica.name).inc()
            self.record_failure(replica, reason, failure)
        return ok

    async def run_probes(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.gather(*(self.probe(session, replica) for replica in self.replicas))
            await asyncio.sleep(self._settings.health_interval_s)

    async def scrape(self, session: aiohttp.ClientSession, replica: ReplicaState) -> EngineGauges | None:
        timeout = aiohttp.ClientTimeout(total=max(self._settings.metrics_interval_s * 2, 1.0))
        gauges: EngineGauges | None = None
        try:
            url = f"{replica.base_url}/metrics"
            async with session.get(url, timeout=timeout, allow_redirects=False) as response:
                body = await read_capped(response, self._settings.max_scrape_bytes)
                if response.status == 200:
                    text = body.decode()
                    gauges = parse_engine_gauges(text)
                    self._note_engine_tokens(replica, engine_token_total(text))
                    if self.on_engine_totals is not None:
                        self.on_engine_totals(replica.name, parse_engine_totals(text))
        except BodyTooLarge:
            self.reject(replica, "scrape_too_large")
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            gauges = None
        if gauges is None:
            self._metrics.scrape_errors.labels(replica.name).inc()
        self._load.observe_engine(replica.name, gauges)
        return gauges

    def _note_engine_tokens(self, replica: ReplicaState, total: float | None) -> None:
        # Rising token counters mean the engine is computing, even when no answer of ours has moved lately (one
        # long non-streaming generation): that is progress, and keeps a slow replica from being called stalled.
        if total is not None and replica.engine_tokens is not None and total > replica.engine_tokens:
            replica.record_progress()
        replica.engine_tokens = total

    async def run_scrapes(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.gather(*(self.scrape(session, r) for r in self.replicas if r.routable))
            await asyncio.sleep(self._settings.metrics_interval_s)


def _refused(error: BaseException | None) -> bool:
    return isinstance(error, aiohttp.ClientConnectorError) and isinstance(error.os_error, ConnectionRefusedError)


WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
TOKEN_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


def engine_token_total(text: str) -> float | None:
    """Prompt plus generated tokens the engine has processed (summed over series); None when not reported."""
    total = 0.0
    seen = False
    for line in text.splitlines():
        if not line.startswith(TOKEN_COUNTERS):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0 or line[:name_end] not in TOKEN_COUNTERS:
            continue
        try:
            rest = line[line.rfind("}") + 1 :] if line[name_end] == "{" else line[name_end:]
            total += float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        seen = True
    return total if seen else None


def parse_engine_gauges(text: str) -> EngineGauges | None:
    """Waiting/running summed over engine series, KV usage averaged; None when the gauges are absent.

    Only the three gauges are read, by a line scan: vLLM's exposition is large and a full parse once a second
    per replica would be wasted work. Older vLLM names KV usage `gpu_cache_usage_perc`; either is accepted.
    """
    waiting = running = 0.0
    usage: list[float] = []
    seen = False
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if name not in (WAITING, RUNNING, *KV_USAGE):
            continue
        try:
            rest = line[line.rfind("}") + 1 :] if line[name_end] == "{" else line[name_end:]
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        seen = True
        if name == WAITING:
            waiting += value
        elif name == RUNNING:
            running += value
        else:
            usage.append(value)
    if not seen:
        return None
    kv_usage = sum(usage) / len(usage) if usage else 0.0
    return EngineGauges(waiting=int(waiting), running=int(running), kv_usage=kv_usage)
