"""Dynamo 1.6.1's simulated vLLM engine ("mocker"), reproduced pass for pass, as the `dynamo-mocker` profile.

Its job is to let kvrouter be judged number for number against Dynamo's own offline replay. The rules:

* KV cache: `num_blocks` blocks of `block_size` tokens. A full block is known by its hash and shared by every
  request that holds it (reference count); a block nobody holds stays cached in an LRU and is reused on a hit.
  Free anonymous capacity is used before any cached block is evicted. Freed blocks enter the LRU tail first (a
  request's last block is evicted first). Trailing partial blocks are anonymous; an output block that fills up
  gets a hash of its own and stays cached like any other full block.
* A pass schedules running requests first in admission order (a decoding request takes 1 token, a chunked
  prefill the rest of its prompt up to the budget), then waiting requests strictly first-come-first-served, within
  `max_batched_tokens` and `max_seqs`. A waiting request is admitted only if its whole prompt fits:
  ceil(tokens / block_size) - (its prefix-hit blocks already in use) <= free blocks (anonymous + evictable). Its
  prefix hits are capped at (prompt_len - 1) // block_size blocks. Room for the whole prompt is reserved at
  admission; a block becomes a cached, hittable block when the chunk computing it is scheduled, so a later
  admission in the same pass already hits it. Nothing is admitted in a pass that preempted.
* Out of blocks for a decode token: the newest running request is preempted (blocks freed, back to the head of
  the queue); admitted again, it computes its whole sequence (prompt and output so far) minus what is still
  cached, and reports that cache hit.
* `policy` "priority" (not in Dynamo 1.6.1's mocker: vLLM's `--scheduling-policy priority`, as
  `kvrouter.sim.waiting` describes it): the waiting queue is ordered by the request's `priority`, then arrival,
  and a preempted request re-enters by that order; the request preempted for a decode token is the running one
  with the largest (priority, arrival). "fcfs" (the default) is the mocker as above.
* Time: prefill_ms = a*T^2 + b*T + c over T uncached tokens in the pass (Dynamo's integer means:
  T = n*(floor(sum prompt/n) - floor(sum prefix/n)) over the n prefilling requests), decode_ms =
  max(1, d2*u^2 + d1*u + d0) with u = (sequence lengths of requests already decoding) / (num_blocks*block_size),
  clamped to 1; a pass costs prefill + decode, each only when it has work. Decoding requests emit one token at
  the end of the pass; a request whose prompt completes in a pass emits its first token then.
* A request whose KV was transferred (`EngineRequest.kv_transferred`, not in Dynamo 1.6.1's mocker) is admitted
  like any other, then counts all but its last prompt token as computed: its blocks are cached at once and its
  first pass prefills one token.

Decoding requests advance in lockstep, so the pass does not touch each of them: a heap holds the pass at which
each one next needs a block or finishes, and the sum of their lengths moves by their count per pass.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from kvrouter.sim.model import (
    CacheCleared,
    EngineGaugesSnapshot,
    EngineRequest,
    KvEvent,
    RemovedBlocks,
    SchedulingPolicy,
    StepResult,
    StoredBlocks,
)
from kvrouter.sim.waiting import OrderKey, order_key, priority_victim, waiting_queue


@dataclass(frozen=True, slots=True)
class MockerConfig:
    """Dynamo 1.6.1's mocker defaults for a vLLM engine."""

    num_blocks: int = 16_384
    block_size: int = 64
    max_batched_tokens: int = 8_192
    max_seqs: int = 256
    prefill_quadratic: float = 4.209989e-7
    prefill_linear: float = 1.518344e-2
    prefill_constant: float = 16.50142
    decode_quadratic: float = -25.74
    decode_linear: float = 54.01
    decode_constant: float = 5.74
    speedup: float = 1.0
    """Divides every pass's duration (Dynamo's speedup_ratio)."""
    policy: SchedulingPolicy = "fcfs"
    """vLLM's --scheduling-policy (see the module docstring); Dynamo 1.6.1's mocker is fcfs."""


@dataclass(slots=True, eq=False)
class _Request:
    spec: EngineRequest
    hashes: list[int]
    """Hashes of the full blocks of the sequence: prompt blocks, then output blocks that filled up."""
    order: int = 0
    """Admission order (set again when a preempted request is admitted again)."""
    epoch: int = 0
    """Bumped whenever the request leaves the running set, which voids its heap entries."""
    registered: int = 0
    """Leading blocks of `hashes` this request holds as cached (hashed) blocks."""
    anonymous: int = 0
    """Blocks held without a hash: reserved for prompt blocks not computed yet, or the trailing partial block."""
    generated: int = 0
    """Output tokens emitted so far (while decoding: as of `base_pass`)."""
    base_pass: int = 0
    to_prefill: int = 0
    """Tokens still to compute before the next output token."""
    prefix_tokens: int = 0
    """Tokens of the sequence already computed or served from cache."""
    decoding: bool = False
    counted: bool = False
    """Its first admission went into the prefix-cache counters."""
    received: int = 0
    """The order the engine received it in (ties of the priority policy, `kvrouter.sim.waiting`)."""

    def generated_at(self, pass_number: int) -> int:
        if not self.decoding:
            return self.generated
        return self.generated + pass_number - self.base_pass


def _order_of(state: _Request) -> OrderKey:
    return order_key(state.spec, state.received)


@dataclass(slots=True)
class _BlockPool:
    """Reference-counted full blocks, an LRU of cached ones and a count of anonymous partial blocks."""

    capacity: int
    block_size: int
    active: dict[int, int] = field(default_factory=dict)
    inactive: OrderedDict[int, None] = field(default_factory=OrderedDict)
    partial: int = 0
    events: list[KvEvent] = field(default_factory=list)

    def free(self) -> int:
        """Blocks a new allocation can take: never used, or cached and evictable."""
        return self.capacity - len(self.active) - self.partial

    def _take_slots(self, count: int) -> None:
        """Make room for `count` more blocks, evicting the least recently freed cached blocks if need be."""
        spare = self.capacity - len(self.active) - self.partial - len(self.inactive)
        if count > spare:
            popitem = self.inactive.popitem
            victims = tuple(popitem(last=False)[0] for _ in range(count - spare))
            self.events.append(RemovedBlocks(victims))

    def hold(self, hashes: list[int]) -> None:
        """Take a reference on cached blocks (prefix hits): in use already, or back from the LRU."""
        active = self.active
        inactive = self.inactive
        for block_hash in hashes:
            count = active.get(block_hash)
            if count is not None:
                active[block_hash] = count + 1
            else:
                del inactive[block_hash]
                active[block_hash] = 1

    def reserve(self, count: int) -> None:
        """Anonymous blocks: free capacity first, then evicted cached blocks."""
        self._take_slots(count)
        self.partial += count

    def register(self, hashes: list[int], parent: int | None) -> None:
        """Reserved blocks were computed: each becomes a cached block under its hash (or joins an equal one)."""
        if not hashes:
            return
        active = self.active
        inactive = self.inactive
        self.partial -= len(hashes)
        if active.keys().isdisjoint(hashes) and inactive.keys().isdisjoint(hashes):
            # The usual case: blocks nobody has computed yet.
            active.update(dict.fromkeys(hashes, 1))
            self.events.append(StoredBlocks(tuple(hashes), parent, None, self.block_size))
            return
        stored: list[int] = []
        for block_hash in hashes:
            count = active.get(block_hash)
            if count is not None:
                active[block_hash] = count + 1
            elif block_hash in inactive:
                del inactive[block_hash]
                active[block_hash] = 1
            else:
                active[block_hash] = 1
                stored.append(block_hash)
        if stored:
            if len(stored) == len(hashes):
                self.events.append(StoredBlocks(tuple(stored), parent, None, self.block_size))
            else:
                for block_hash in stored:
                    position = hashes.index(block_hash)
                    before = hashes[position - 1] if position else parent
                    self.events.append(StoredBlocks((block_hash,), before, None, self.block_size))

    def release(self, hashes: list[int], anonymous: int) -> None:
        self.partial -= anonymous
        active = self.active
        for block_hash in reversed(hashes):
            count = active[block_hash] - 1
            if count:
                active[block_hash] = count
            else:
                del active[block_hash]
                self.inactive[block_hash] = None


class DynamoMockerEngine:
    """An `EngineModel` reproducing Dynamo 1.6.1's mocker; see the module docstring for the rules."""

    def __init__(self, config: MockerConfig | None = None) -> None:
        self.config = config or MockerConfig()
        self.block_size = self.config.block_size
        self.max_num_seqs = self.config.max_seqs
        self._pool = _BlockPool(self.config.num_blocks, self.config.block_size)
        self._requests: dict[str, _Request] = {}
        self._waiting = waiting_queue(self.config.policy, _order_of)
        self._by_priority = self.config.policy == "priority"
        self._running: dict[str, _Request] = {}
        """Admission order, decoders and prefills together."""
        self._decoders: dict[str, _Request] = {}
        self._block_heap: list[tuple[int, int, int, _Request]] = []
        """(pass at whose start a decoder needs a new block, order, epoch, request)."""
        self._finish_heap: list[tuple[int, int, int, _Request]] = []
        """(pass at whose end a decoder emits its last token, order, epoch, request)."""
        self._decode_len_sum = 0
        """Decoders' sequence lengths at the start of the current pass."""
        self._pass = 0
        self._orders = 0
        self._received = 0
        self._output_hashes = 0
        self._prefix_queries = 0
        self._prefix_hits = 0

    # -- the EngineModel protocol ---------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        state = _Request(request, list(request.block_hashes), received=self._received)
        self._received += 1
        self._requests[request.request_id] = state
        self._waiting.add(state)

    def abort(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        if request_id in self._running:
            self._leave_running(state)
            self._release(state)
        else:
            self._waiting.remove(state)

    def has_work(self) -> bool:
        return bool(self._requests)

    def reset_prefix_cache(self) -> bool:
        pool = self._pool
        if pool.active or pool.partial:
            return False
        pool.inactive.clear()
        pool.events.append(CacheCleared())
        return True

    def gauges(self) -> EngineGaugesSnapshot:
        pool = self._pool
        return EngineGaugesSnapshot(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_usage=(len(pool.active) + pool.partial) / pool.capacity,
            prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits,
        )

    def step(self, now: float) -> StepResult:
        del now  # a pass's cost depends on its contents only
        result = StepResult(duration=0.0)
        decoding = len(self._decoders)
        decode_len = self._decode_len_sum
        preempted = self._grow_decoders(result)
        budget = self.config.max_batched_tokens - len(self._decoders)
        prefills: list[tuple[_Request, int]] = []
        for state in self._running.values():
            if budget <= 0:
                break
            if not state.decoding:
                chunk = min(state.to_prefill, budget)
                self._schedule_prefill(state, chunk, prefills)
                budget -= chunk
        if not preempted:
            self._admit(budget, prefills, result)
        duration_ms = self._prefill_ms(prefills) + self._decode_ms(decoding, decode_len)
        self._end_pass(prefills, result)
        result.duration = duration_ms / 1000.0 / self.config.speedup
        result.events = self._pool.events
        self._pool.events = []
        return result

    # -- scheduling ------------------------------------------------------------------------------------------

    def _grow_decoders(self, result: StepResult) -> bool:
        """Decoders whose next token needs a block get one; when none is left, the newest running request goes."""
        heap = self._block_heap
        current = self._pass
        due: list[_Request] = []
        while heap and heap[0][0] <= current:
            _, _, epoch, state = heapq.heappop(heap)
            if epoch == state.epoch:
                due.append(state)
        preempted = False
        pool = self._pool
        for state in due:  # heap order is admission order within a pass
            if not state.decoding:
                continue  # preempted earlier in this pass
            while pool.free() <= 0:
                if self._by_priority:
                    victim = priority_victim(self._running.values(), _order_of)
                else:
                    victim = next(reversed(self._running.values()))
                self._preempt(victim, result)
                preempted = True
                if victim is state:
                    break
            if not state.decoding:
                continue
            if state.anonymous:
                # The trailing block is full: it becomes a cached block under a hash of its own.
                if state.registered == len(state.hashes):
                    self._output_hashes += 1
                    state.hashes.append(-self._output_hashes)
                parent = state.hashes[state.registered - 1] if state.registered else None
                pool.register(state.hashes[state.registered : state.registered + 1], parent)
                state.registered += 1
                state.anonymous -= 1
            pool.reserve(1)
            state.anonymous += 1
            self._push_block_event(state)
        return preempted

    def _push_block_event(self, state: _Request) -> None:
        """A decode pass computes the last emitted token, so it needs room for the whole sequence at its start."""
        length = state.spec.prompt_len + state.generated_at(self._pass)
        capacity = (state.registered + state.anonymous) * self.block_size
        heapq.heappush(self._block_heap, (self._pass + capacity - length + 1, state.order, state.epoch, state))

    def _leave_running(self, state: _Request) -> None:
        del self._running[state.spec.request_id]
        if state.decoding:
            generated = state.generated_at(self._pass)
            self._decode_len_sum -= state.spec.prompt_len + generated
            state.generated = generated
            state.decoding = False
            del self._decoders[state.spec.request_id]
        state.epoch += 1

    def _release(self, state: _Request) -> None:
        self._pool.release(state.hashes[: state.registered], state.anonymous)
        state.registered = 0
        state.anonymous = 0

    def _preempt(self, state: _Request, result: StepResult) -> None:
        self._leave_running(state)
        self._release(state)
        self._waiting.put_back(state)
        result.preempted.append(state.spec.request_id)

    def _schedule_prefill(self, state: _Request, chunk: int, prefills: list[tuple[_Request, int]]) -> None:
        """Blocks this chunk completes become cached now, so later admissions in the same pass hit them."""
        prefills.append((state, chunk))
        covered = min(len(state.hashes), (state.prefix_tokens + chunk) // self.block_size)
        if covered > state.registered:
            parent = state.hashes[state.registered - 1] if state.registered else None
            self._pool.register(state.hashes[state.registered : covered], parent)
            state.anonymous -= covered - state.registered
            state.registered = covered

    def _admit(self, budget: int, prefills: list[tuple[_Request, int]], result: StepResult) -> None:
        pool = self._pool
        active = pool.active
        inactive = pool.inactive
        size = self.block_size
        waiting = self._waiting
        max_seqs = self.config.max_seqs
        while waiting and budget > 0 and len(self._running) < max_seqs:
            state = waiting.head()
            spec = state.spec
            tokens = spec.prompt_len + state.generated
            limit = (tokens - 1) // size
            hits = 0
            in_use = 0
            for block_hash in state.hashes:
                if hits >= limit:
                    break
                if block_hash in active:
                    in_use += 1
                elif block_hash not in inactive:
                    break
                hits += 1
            needed = -(-tokens // size)
            if needed - in_use > pool.free():
                break
            waiting.take()
            pool.hold(state.hashes[:hits])
            pool.reserve(needed - hits)
            state.registered = hits
            state.anonymous = needed - hits
            state.prefix_tokens = hits * size
            result.cached_tokens[spec.request_id] = state.prefix_tokens
            if spec.kv_transferred and not state.counted:
                # A decode leg: the rest of the prompt arrived with it (a preempted one recomputes).
                state.prefix_tokens = max(state.prefix_tokens, tokens - 1)
            state.to_prefill = tokens - state.prefix_tokens
            if state.generated == 0 and not state.counted:
                state.counted = True
                self._prefix_queries += spec.prompt_len
                self._prefix_hits += hits * size
            self._orders += 1
            state.order = self._orders
            self._running[spec.request_id] = state
            chunk = min(state.to_prefill, budget)
            self._schedule_prefill(state, chunk, prefills)
            budget -= chunk

    def _prefill_ms(self, prefills: list[tuple[_Request, int]]) -> float:
        count = len(prefills)
        if count == 0:
            return 0.0
        prompt_sum = 0
        prefix_sum = 0
        for state, chunk in prefills:
            prompt_sum += state.prefix_tokens + chunk
            prefix_sum += state.prefix_tokens
        tokens = count * (prompt_sum // count - prefix_sum // count)
        config = self.config
        return config.prefill_quadratic * tokens * tokens + config.prefill_linear * tokens + config.prefill_constant

    def _decode_ms(self, decoding: int, length_sum: int) -> float:
        if decoding == 0:
            return 0.0
        config = self.config
        usage = min(1.0, length_sum / (config.num_blocks * config.block_size))
        return max(1.0, config.decode_quadratic * usage * usage + config.decode_linear * usage + config.decode_constant)

    def _end_pass(self, prefills: list[tuple[_Request, int]], result: StepResult) -> None:
        """Decoders emit a token, completed prompts their next (usually first) one; finished requests leave."""
        current = self._pass
        result.tokens.extend(self._decoders)
        heap = self._finish_heap
        while heap and heap[0][0] <= current:
            _, _, epoch, state = heapq.heappop(heap)
            if epoch == state.epoch:
                self._finish(state, result)
        self._pass = current + 1
        self._decode_len_sum += len(self._decoders)
        for state, chunk in prefills:
            state.to_prefill -= chunk
            state.prefix_tokens += chunk
            if state.to_prefill > 0:
                continue
            request_id = state.spec.request_id
            if state.generated == 0:
                result.first_tokens.append(request_id)
            result.tokens.append(request_id)
            state.generated += 1
            if state.generated >= state.spec.max_tokens:
                self._finish(state, result)
                continue
            state.decoding = True
            state.base_pass = self._pass
            self._decoders[request_id] = state
            self._decode_len_sum += state.spec.prompt_len + state.generated
            self._push_block_event(state)
            last_pass = self._pass + state.spec.max_tokens - state.generated - 1
            heapq.heappush(self._finish_heap, (last_pass, state.order, state.epoch, state))

    def _finish(self, state: _Request, result: StepResult) -> None:
        self._leave_running(state)
        self._release(state)
        del self._requests[state.spec.request_id]
        result.finished.append(state.spec.request_id)
