"""The routing core shared by the live proxy and virtual-time replay: one implementation, two clocks.

`Router.facts` turns a parsed request into `RoutingFacts` (exact token ids, off the event loop, via the
`PromptTokenizer`); `Router.decide` keeps the candidates that serve the request's LoRA adapter
(`kvrouter.routing.adapters`), asks the prefix index how much of the prompt each candidate holds (and in which
tier), applies the engine's cached-token rule, reads each replica's load from the `LoadBook`, looks up the replica
that served the request's session last (`kvrouter.routing.sessions`: a soft hint for the policy, or the choice
itself in sticky mode) and lets the policy choose — with no side effects, so `/debug/route` can call it; with
shared load between instances, through the `BlindGroup` (`kvrouter.routing.herding`: the peers' decisions this
instance cannot see yet placed first, so instances reading the same stale picture do not herd);
`Router.commit` acts on a decision: the policy's state moves, the session table remembers the replica, the
request's blocks become provisional entries on the chosen replica, the load book gets a ticket, and the caller gets
a `Routed` handle (`kvrouter.routing.lifecycle`) that carries the rest of the request's life — first token, the
engine's cached-token report, finish — to the load book, the policy and the request listeners (the learning
overlays built by `kvrouter.routing.overlays`). The clock is a parameter (`time.monotonic` live, the virtual clock
in replay).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvrouter.blocks import cacheable_tokens, chain_keys
from kvrouter.openai_request import ParsedRequest, RequestError
from kvrouter.policies.base import Candidate, Decision, Policy, RouteRequest
from kvrouter.routing.adapters import serving
from kvrouter.routing.herding import BlindGroup
from kvrouter.routing.lifecycle import Leg, RequestListener, Routed
from kvrouter.routing.load import LoadBook
from kvrouter.routing.sessions import SessionTable
from kvrouter.typedefs import BlockKey, ReplicaName, ReplicaRole, Tier


class PromptTokenizer(Protocol):
    async def prompt_token_ids(self, request: ParsedRequest) -> Sequence[Sequence[int]]:
        """Token ids the engine will see, one list per prompt (a batch has several); raises RequestError."""
        ...


class KnownPromptKeys(Protocol):
    def __call__(
        self, ids: Sequence[int], block_size: int, *, seed: int, lora: str | None, cache_salt: str | None
    ) -> list[BlockKey] | None:
        """A tokenizer's block keys for a prompt it returned (reusing those of a cached prefix), bit for bit
        `chain_keys`'; None: not one it knows, hash it."""
        ...


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A replica's longest cached prefix of a request, in blocks, by tier (GPU first).

    The engine serves the leading `gpu_blocks` from GPU memory and loads the rest of `blocks` from its offload
    tiers (vLLM asks its KV connector only for what follows the GPU prefix hit): up to `host_blocks` from CPU
    memory, beyond that from storage."""

    blocks: int
    gpu_blocks: int
    host_blocks: int | None = None
    """Leading blocks held on GPU or in CPU memory; None: all of `blocks` (nothing only in storage)."""

    def tier_blocks(self, credited: int) -> tuple[int, int, int]:
        """The first `credited` blocks of the match split by where the engine takes them from: GPU, CPU, storage."""
        host = self.blocks if self.host_blocks is None else self.host_blocks
        gpu = min(credited, self.gpu_blocks)
        cpu = max(0, min(credited, host) - gpu)
        return gpu, cpu, max(0, credited - gpu - cpu)

    def cut(self, blocks: int) -> PrefixMatch:
        """The same match shortened to its first `blocks` blocks (an overlay trimmed it)."""
        host = None if self.host_blocks is None else min(self.host_blocks, blocks)
        return PrefixMatch(blocks, min(self.gpu_blocks, blocks), host)


class PrefixLookup(Protocol):
    def longest_prefixes(self, keys: Sequence[BlockKey], now: float) -> Mapping[ReplicaName, PrefixMatch]:
        """For every replica holding at least the first key: how many leading keys it holds."""
        ...

    def add_provisional(self, replica: ReplicaName, keys: Sequence[BlockKey], now: float) -> None:
        """Count `keys` as cached on `replica` until events confirm them or the TTL passes."""
        ...


@dataclass(frozen=True, slots=True)
class Route:
    """A replica as the router sees it at decision time."""

    name: ReplicaName
    block_size: int
    weight: float = 1.0
    lora_adapters: frozenset[str] | None = None
    """The LoRA adapters the replica serves (`kvrouter.routing.adapters`); None: placement unknown, all of them."""
    role: ReplicaRole = "both"
    """What the replica does in a disaggregated fleet (`kvrouter.routing.disagg`)."""


@dataclass(slots=True)
class RoutingFacts:
    prompts: Sequence[Sequence[int]] | None
    """None when no tokenizer is configured (routing on load only). A prompt may be a read-only array('I')."""
    lora: str | None = None
    cache_salt: str | None = None
    max_tokens: int | None = None
    session: str | None = None
    """The request's session key (`kvrouter.server.session_keys`), when it has one."""
    known_keys: KnownPromptKeys | None = None
    """The tokenizer's keys for its prompts (`HfPromptTokenizer.block_keys`), when it keeps them."""
    _keys: dict[int, list[BlockKey]] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int | None:
        if self.prompts is None:
            return None
        return sum(len(prompt) for prompt in self.prompts)

    def keys(self, block_size: int, seed: int) -> list[BlockKey]:
        """Keys of the first prompt (a batch shares one replica; the first prompt stands for its prefix)."""
        if not self.prompts:
            return []
        cached = self._keys.get(block_size)
        if cached is None:
            prompt = self.prompts[0]
            if self.known_keys is not None:
                cached = self.known_keys(prompt, block_size, seed=seed, lora=self.lora, cache_salt=self.cache_salt)
            if cached is None:
                cached = chain_keys(prompt, block_size, seed=seed, lora=self.lora, cache_salt=self.cache_salt)
            self._keys[block_size] = cached
        return cached


class Router:
    def __init__(
        self,
        *,
        policy: Policy,
        load: LoadBook,
        index: PrefixLookup | None = None,
        tokenizer: PromptTokenizer | None = None,
        hash_seed: int = 0,
        lora_adapters: Iterable[str] = (),
        listeners: Sequence[RequestListener] = (),
        sessions: SessionTable | None = None,
        blind_group: BlindGroup | None = None,
        clock: Callable[[], float],
    ) -> None:
        self.policy = policy
        self.blind_group = blind_group
        """With shared load: the peers' decisions this instance cannot see yet (`kvrouter.routing.herding`)."""
        self.sessions = sessions
        self.load = load
        self.index = index
        self.tokenizer = tokenizer
        block_keys = getattr(tokenizer, "block_keys", None)
        self._known_keys: KnownPromptKeys | None = block_keys if callable(block_keys) else None
        self.hash_seed = hash_seed
        self.lora_adapters = frozenset(lora_adapters)
        self.listeners = tuple(listeners)
        self.clock = clock

    def add_listener(self, listener: RequestListener) -> None:
        """One more listener of every routed request's life (a part built after the router: the flow gate)."""
        self.listeners = (*self.listeners, listener)

    async def facts(self, request: ParsedRequest) -> RoutingFacts:
        prompts = None
        if self.tokenizer is not None:
            try:
                prompts = await self.tokenizer.prompt_token_ids(request)
            except RequestError:
                raise
            except Exception as error:
                # Text the tokenizer cannot take (a lone surrogate, ...) is no reason for a 500: the request is
                # routed on load alone and the engine gives its own verdict. No prompt text in the log.
                logging.getLogger(__name__).info("request not tokenized (%s): routed on load", type(error).__name__)
        lora = request.model if request.model in self.lora_adapters else None
        return RoutingFacts(
            prompts,
            lora=lora,
            cache_salt=request.cache_salt,
            max_tokens=request.max_tokens,
            known_keys=self._known_keys,
        )

    def candidates(self, facts: RoutingFacts, routes: Sequence[Route]) -> list[Candidate]:
        now = self.clock()
        matches: dict[int, Mapping[ReplicaName, PrefixMatch]] = {}
        result = []
        for route in routes:
            cached = 0
            lower = (0, 0)
            if self.index is not None and facts.prompts:
                by_replica = matches.get(route.block_size)
                if by_replica is None:
                    keys = facts.keys(route.block_size, self.hash_seed)
                    by_replica = self.index.longest_prefixes(keys, now) if keys else {}
                    matches[route.block_size] = by_replica
                match = by_replica.get(route.name)
                if match is not None:
                    cached = cacheable_tokens(len(facts.prompts[0]), match.blocks, route.block_size)
                    if match.gpu_blocks * route.block_size < cached:
                        _, cpu, storage = match.tier_blocks(cached // route.block_size)
                        lower = (cpu * route.block_size, storage * route.block_size)
            result.append(Candidate(route.name, cached, self.load.snapshot(route.name), route.weight, *lower))
        return result

    def serving(self, facts: RoutingFacts, routes: Sequence[Route]) -> list[Route]:
        """The routes that may take the request: those serving its LoRA adapter, if it names one."""
        return serving(routes, facts.lora)

    def decide(self, facts: RoutingFacts, routes: Sequence[Route]) -> Decision:
        """Choose among `routes` that serve the request's adapter (at least one must: see `serving`). No side
        effects."""
        routes = serving(routes, facts.lora)
        if not routes:
            raise ValueError(f"no candidate serves the LoRA adapter {facts.lora!r}")
        hinted = self._hint(facts, routes)
        sticky = self.sessions is not None and self.sessions.mode == "sticky"
        request = RouteRequest(
            prompt_tokens=facts.prompt_tokens,
            max_tokens=facts.max_tokens,
            session_replica=None if sticky else hinted,
        )
        offered = self.candidates(facts, routes)
        if self.blind_group is None:
            decision = self.policy.select(request, offered)
        else:
            decision = self.blind_group.select(self.policy, request, offered, self.clock())
        if sticky and hinted is not None:
            # Strict stickiness: the session's replica while it is routable, whatever the policy thinks of it.
            candidates = tuple(
                replace(c, breakdown={**c.breakdown, "session_sticky": 1.0}) if c.replica == hinted else c
                for c in decision.candidates
            )
            alone = decision.chosen if decision.chosen != hinted else None
            decision = Decision(hinted, candidates, without_hint=alone)
        return decision

    def _hint(self, facts: RoutingFacts, routes: Sequence[Route]) -> ReplicaName | None:
        """The replica that served the request's session last, if it is among `routes`."""
        if self.sessions is None or facts.session is None:
            return None
        replica = self.sessions.replica_of(facts.session, self.clock())
        return replica if replica is not None and any(route.name == replica for route in routes) else None

    def commit(
        self,
        decision: Decision,
        facts: RoutingFacts,
        route: Route,
        *,
        arrival: float | None = None,
        policy: Policy | None = None,
        computes: int | None = None,
        session: bool = True,
        leg: Leg = "whole",
    ) -> Routed:
        """Act on `decision` for `route` (its chosen replica); `arrival` (default: now) is when the request came.

        A leg of a disaggregated request (`kvrouter.routing.disagg`) overrides three things: the `policy` that made
        the decision (and hears its outcome), the prompt tokens the replica `computes` (a decode leg receives its
        KV and computes none; default: the prompt less what is predicted cached) and whether the replica becomes
        the `session`'s last (the decode leg, not the prefill leg)."""
        now = self.clock()
        policy = self.policy if policy is None else policy
        policy.record(decision)
        sessions = self.sessions
        if session and sessions is not None and facts.session is not None:
            hinted = sessions.replica_of(facts.session, now)
            had_hint = hinted is not None and decision.score_of(hinted) is not None
            sessions.count(hinted=had_hint, changed=decision.without_hint is not None)
            sessions.remember(facts.session, route.name, now)
        chosen = decision.score_of(decision.chosen)
        cached = chosen.cached_tokens if chosen is not None else 0
        prompt_tokens = facts.prompt_tokens or 0
        keys: list[BlockKey] = []
        if self.index is not None and facts.prompts:
            keys = facts.keys(route.block_size, self.hash_seed)
            if keys:
                self.index.add_provisional(route.name, keys, now)
        routed = Routed(
            decision=decision,
            replica=route.name,
            block_size=route.block_size,
            keys=keys,
            prompt_tokens=prompt_tokens,
            predicted_cached=cached,
            arrival=now if arrival is None else arrival,
            ticket=self.load.begin(route.name, max(0, prompt_tokens - cached) if computes is None else computes),
            load=self.load,
            policy=policy,
            listeners=self.listeners,
            leg=leg,
        )
        if self.blind_group is not None and policy is self.policy:
            self.blind_group.committed(decision, routed.ticket.prefill_tokens, now)
        for listener in self.listeners:
            listener.on_commit(routed)
        return routed


__all__ = ["PrefixLookup", "PrefixMatch", "PromptTokenizer", "Route", "Routed", "Router", "RoutingFacts", "Tier"]
