"""A vLLM-v1-like engine model: continuous batching over a prefix-cached paged KV cache (pure, clock-free).

One `step(now)` is one scheduler pass as vLLM v1 makes it (chunked prefill on; `policy` fcfs, vLLM's default, or
priority, `kvrouter.sim.waiting`):

1. Running requests, in order, each get the tokens they still need (1 when decoding, the rest of the prompt when
   prefilling) capped by the pass's token budget (`max_num_batched_tokens`). When the cache cannot give a request
   its blocks, a running request is preempted (blocks freed, progress dropped, put back in the waiting queue)
   until it can, or the request preempts itself: under fcfs the most recently admitted one (back at the head of
   the queue), under priority the least urgent, newest first (back by its order; if it was already scheduled in
   this pass its tokens return to the budget).
2. If nothing was preempted, waiting requests are admitted in the queue's order (fcfs: arrival; priority: by
   `priority`, then arrival) while the budget lasts, `max_num_seqs` is
   not reached and the cache has room: each first looks up its prefix (at most `prompt - 1` tokens, whole blocks),
   then gets the remaining tokens up to the budget (chunked prefill); it is admitted only if blocks for its whole
   prompt are free (`reserve_full_prompt`, vLLM's scheduler_reserve_full_isl). The prefix-cache query/hit
   counters count a request when it is admitted, except a preempted one coming back (recent vLLM's
   PrefixCacheStats). A request whose KV was transferred (`EngineRequest.kv_transferred`) is admitted with all
   but its last prompt token computed; the counters and `cached_tokens` count its local hits only.
3. Blocks that become full when scheduled are cached at once (so a request admitted later in the same pass
   already hits them), including blocks filled by generated tokens.
4. The pass takes `timing.step_time(...)` seconds; every request whose known tokens are all computed emits one
   token at its end; a request that reached `max_tokens` finishes and frees its blocks (tail first).

Knobs: `max_num_seqs`, `max_num_batched_tokens`, `reserve_full_prompt`, `policy`, `num_blocks` and `block_size`
(the cache), `timing` (a profile),
`hash_seed` (the root of the engine's own block hashes). Work per pass is O(scheduled requests + blocks that
change); tokens are never materialised unless the request came with token ids.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Protocol

from kvrouter.sim.cache import PrefixCache
from kvrouter.sim.hashing import block_extras, hash_block, hash_label, root_hash
from kvrouter.sim.model import (
    EngineGaugesSnapshot,
    EngineRequest,
    KvEvent,
    SchedulingPolicy,
    StepResult,
    StoredBlocks,
)
from kvrouter.sim.waiting import OrderKey, order_key, priority_victim, waiting_queue


class StepTiming(Protocol):
    def step_time(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, prefill_attention: float) -> float:
        """Seconds for one pass: prompt tokens computed, decoding sequences, tokens of KV read by attention,
        and sum over prefill chunks of chunk length x mean context of the chunk (the quadratic part)."""
        ...


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_blocks: int = 4096
    """Usable KV blocks (vLLM's num_gpu_blocks minus the null block)."""
    block_size: int = 16
    reserve_full_prompt: bool = True
    """Admit a waiting request only if its whole prompt fits, not just its first chunk (vLLM's
    scheduler_reserve_full_isl, on by default in recent versions)."""
    policy: SchedulingPolicy = "fcfs"
    """vLLM's --scheduling-policy: the waiting queue's order and the preemption victim (`kvrouter.sim.waiting`)."""


class _Seq:
    __slots__ = (
        "base",
        "blocks",
        "hashes",
        "label_base",
        "max_tokens",
        "num_computed",
        "num_output",
        "num_tokens",
        "order",
        "preemptions",
        "prompt_len",
        "received",
        "reported",
        "request",
        "unhashed",
    )

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.prompt_len = request.prompt_len
        self.max_tokens = request.max_tokens
        self.hashes: list[int] = list(request.block_hashes)
        self.num_tokens = request.prompt_len
        self.num_computed = 0
        self.num_output = 0
        self.blocks: list[int] = []
        """Ids of this request's hashed (full) blocks, in order; `unhashed` more blocks follow them."""
        self.unhashed = 0
        self.preemptions = 0
        self.reported = False
        self.label_base = -1
        self.received = 0
        """The order the engine received it in (ties of the priority policy, `kvrouter.sim.waiting`)."""
        self.order = 0
        """Position in the running batch (admission counter): the order vLLM schedules running requests in."""
        self.base = 0
        """Pass at which the counters above were last brought up to date (lockstep decoding defers them)."""

    def token_slice(self, start: int, end: int) -> tuple[int, ...] | None:
        """Tokens [start, end) of prompt + output, when the request carries real tokens."""
        prompt = self.request.token_ids
        if prompt is None:
            return None
        if end <= self.prompt_len:
            return tuple(prompt[start:end])
        head = tuple(prompt[start : self.prompt_len]) if start < self.prompt_len else ()
        out_start = max(0, start - self.prompt_len)
        out_end = end - self.prompt_len
        outputs = self.request.output_token_ids
        if outputs is None or len(outputs) < out_end:
            # No chosen outputs: a fixed filler token keeps events well-formed (hashes still differ per request
            # only through the prompt, as they would for a deterministic model).
            filler = prompt[-1] if len(prompt) else 0
            return head + (filler,) * (out_end - out_start)
        return head + tuple(outputs[out_start:out_end])


def _order_of(seq: _Seq) -> OrderKey:
    return order_key(seq.request, seq.received)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class VllmEngine:
    """The vLLM v1 engine model; see the module docstring."""

    def __init__(self, config: SchedulerConfig, timing: StepTiming, *, hash_seed: int = 0) -> None:
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.config = config
        self.timing = timing
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.cache = PrefixCache(config.num_blocks, config.block_size)
        self.hash_seed = hash_seed
        self._root = root_hash(hash_seed)
        self._waiting = waiting_queue(config.policy, _order_of)
        self._by_priority = config.policy == "priority"
        self._running: list[_Seq] = []
        self._seqs: dict[str, _Seq] = {}
        self._queries = 0
        self._hits = 0
        self._orders = 0
        self._received = 0
        # Lockstep decoding: while every running request is decoding, a pass only touches the requests that
        # reach a block boundary or finish in it (a heap of those passes); the others' counters catch up lazily.
        self._pass = 0
        self._lockstep = False
        self._heap: list[tuple[int, int, _Seq]] = []
        self._decode_context = 0
        """Sum of the running requests' computed tokens at the start of the pass (valid in lockstep)."""
        self._rids: list[str] | None = None
        self.lockstep_enabled = config.max_num_seqs <= config.max_num_batched_tokens

    # -- EngineModel ---------------------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        if request.request_id in self._seqs:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        if request.prompt_len < 1 or request.max_tokens < 1:
            raise ValueError("a request needs at least one prompt token and max_tokens >= 1")
        needed = _cdiv(request.prompt_len + request.max_tokens - 1, self.block_size)
        if needed > self.config.num_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks, the cache has {self.config.num_blocks}; it could never run"
            )
        seq = _Seq(request)
        seq.received = self._received
        self._received += 1
        self._seqs[request.request_id] = seq
        self._waiting.add(seq)

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        if seq in self._running:
            self._leave_lockstep()
            self._running.remove(seq)
            self._rids = None
            self._release(seq)
        else:
            self._waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def reset_prefix_cache(self) -> bool:
        return self.cache.reset()

    def take_events(self) -> list[KvEvent]:
        """Events raised outside a pass (a prefix-cache reset on an idle engine), for the driver to publish."""
        events = self.cache.events
        self.cache.events = []
        return events

    def gauges(self) -> EngineGaugesSnapshot:
        return EngineGaugesSnapshot(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_usage=self.cache.usage(),
            prefix_queries=self._queries,
            prefix_hits=self._hits,
        )

    def step(self, now: float) -> StepResult:
        if self._lockstep and not (self._waiting and len(self._running) < self.config.max_num_seqs):
            fast = self._lockstep_step()
            if fast is not None:
                return fast
        self._leave_lockstep()
        result = StepResult(duration=0.0)
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[_Seq, int]] = []
        if self._running:
            budget = self._schedule_running(scheduled, budget, result)
        if budget > 0 and self._waiting:
            self._schedule_waiting(scheduled, budget, result)
        result.duration = self._execute(scheduled, result)
        result.events = self.cache.events
        self.cache.events = []
        self._pass += 1
        self._rids = None
        self._enter_lockstep()
        return result

    # -- scheduling ----------------------------------------------------------------------------------------

    def _schedule_running(self, scheduled: list[tuple[_Seq, int]], budget: int, result: StepResult) -> int:
        """Schedule running requests; the budget left, or 0 when a preemption closes admission this pass."""
        running = self._running
        cache = self.cache
        block_size = self.block_size
        preempted = False
        index = 0
        while index < len(running) and budget > 0:
            seq = running[index]
            computed = seq.num_computed
            new = seq.num_tokens - computed
            if new > budget:
                new = budget
            end = computed + new
            held = len(seq.blocks) + seq.unhashed
            if end > held * block_size:
                need = -(-end // block_size) - held
                while need > cache.free_blocks:
                    if self._by_priority:
                        victim = priority_victim(running, _order_of)
                        position = running.index(victim)
                        del running[position]
                        if position < index:  # scheduled earlier in this pass: its tokens go back to the budget
                            slot = next(i for i, (done, _) in enumerate(scheduled) if done is victim)
                            budget += scheduled.pop(slot)[1]
                            index -= 1
                    else:
                        victim = running.pop()
                    self._preempt(victim)
                    result.preempted.append(victim.request.request_id)
                    preempted = True
                    if victim is seq:
                        return 0  # it gave up its own blocks: nothing more is scheduled from the running list
                cache.allocate(need)
                seq.unhashed += need
            if end // block_size > len(seq.blocks):
                self._cache_full_blocks(seq, end)
            scheduled.append((seq, new))
            budget -= new
            index += 1
        return 0 if preempted else budget

    def _schedule_waiting(self, scheduled: list[tuple[_Seq, int]], budget: int, result: StepResult) -> None:
        waiting = self._waiting
        running = self._running
        cache = self.cache
        block_size = self.block_size
        max_seqs = self.config.max_num_seqs
        reserve_full = self.config.reserve_full_prompt
        while waiting and budget > 0 and len(running) < max_seqs:
            seq = waiting.head()
            hits = cache.lookup(seq.hashes, (seq.num_tokens - 1) // block_size)
            hit_tokens = len(hits) * block_size
            computed = hit_tokens
            if seq.request.kv_transferred and seq.preemptions == 0:
                computed = max(hit_tokens, seq.num_tokens - 1)  # the rest of the prompt arrived with the request
            new = seq.num_tokens - computed
            if new > budget:
                new = budget
            need = _cdiv(computed + new, block_size) - len(hits)
            check = need
            if reserve_full and seq.num_tokens > computed + new:
                check = _cdiv(seq.num_tokens, block_size) - len(hits)
            if check + cache.evictable(hits) > cache.free_blocks:
                break
            if seq.preemptions == 0:
                self._queries += seq.num_tokens
                self._hits += hit_tokens
            waiting.take()
            cache.touch(hits)
            seq.blocks = hits
            cache.allocate(need)
            seq.unhashed = need
            seq.num_computed = computed
            if not seq.reported:
                seq.reported = True
                result.cached_tokens[seq.request.request_id] = hit_tokens
            self._cache_full_blocks(seq, computed + new)
            seq.order = self._orders
            self._orders += 1
            running.append(seq)
            scheduled.append((seq, new))
            budget -= new

    def _cache_full_blocks(self, seq: _Seq, tokens_after: int) -> None:
        """Hash and cache the blocks that `tokens_after` computed tokens fill (vLLM caches at scheduling)."""
        first = len(seq.blocks)
        full = tokens_after // self.block_size
        if full <= first:
            return
        block_size = self.block_size
        hashes = seq.hashes
        cache = self.cache
        while len(hashes) < full:
            hashes.append(self._output_block_hash(seq, len(hashes)))
        new_hashes = hashes[first:full]
        seq.blocks.extend(cache.commit_many(new_hashes))
        seq.unhashed -= full - first
        request = seq.request
        cache.events.append(
            StoredBlocks(
                block_hashes=tuple(new_hashes),
                parent_hash=hashes[first - 1] if first else None,
                token_ids=seq.token_slice(first * block_size, full * block_size),
                block_size=block_size,
                cache_salt=request.cache_salt if first == 0 else None,
                lora_name=request.lora_name,
                lora_id=request.lora_id,
            )
        )

    def _output_block_hash(self, seq: _Seq, index: int) -> int:
        parent = seq.hashes[index - 1] if index else self._root
        tokens = seq.token_slice(index * self.block_size, (index + 1) * self.block_size)
        if tokens is not None:
            request = seq.request
            return hash_block(parent, tokens, block_extras(index, request.lora_name, request.cache_salt))
        if seq.label_base < 0:
            digest = blake2b(seq.request.request_id.encode(), digest_size=7).digest()
            seq.label_base = int.from_bytes(digest, "little") << 8
        return hash_label(parent, seq.label_base + index)

    def _preempt(self, seq: _Seq) -> None:
        self._release(seq)
        seq.num_computed = 0
        seq.preemptions += 1
        self._waiting.put_back(seq)

    def _release(self, seq: _Seq) -> None:
        self.cache.free(seq.blocks, seq.unhashed)
        seq.blocks = []
        seq.unhashed = 0

    # -- lockstep decoding ----------------------------------------------------------------------------------

    def _next_event(self, seq: _Seq) -> int:
        """The pass (from `seq.base`) in which `seq` next needs a block, fills one, or emits its last token."""
        computed = seq.num_computed
        block_size = self.block_size
        needs_block = -computed % block_size
        fills_block = -(computed + 1) % block_size
        last_token = seq.max_tokens - seq.num_output - 1
        return seq.base + min(needs_block, fills_block, last_token)

    def _enter_lockstep(self) -> None:
        running = self._running
        if not self.lockstep_enabled or not running:
            return
        for seq in running:
            if seq.num_output == 0 or seq.num_computed != seq.num_tokens - 1:
                return  # a prefill is in the batch: passes stay general
        now = self._pass
        context = 0
        heap = []
        for seq in running:
            seq.base = now
            context += seq.num_computed
            heap.append((self._next_event(seq), seq.order, seq))
        heapq.heapify(heap)
        self._heap = heap
        self._decode_context = context
        self._lockstep = True

    def _catch_up(self, seq: _Seq) -> None:
        lag = self._pass - seq.base
        if lag:
            seq.num_computed += lag
            seq.num_tokens += lag
            seq.num_output += lag
            seq.base = self._pass

    def _leave_lockstep(self) -> None:
        if not self._lockstep:
            return
        for seq in self._running:
            self._catch_up(seq)
        self._heap = []
        self._lockstep = False

    def _lockstep_step(self) -> StepResult | None:
        """One all-decode pass touching only the requests with something to do in it; None to go general."""
        heap = self._heap
        now = self._pass
        due: list[_Seq] = []
        while heap and heap[0][0] == now:
            due.append(heapq.heappop(heap)[2])
        block_size = self.block_size
        cache = self.cache
        needs = 0
        for seq in due:
            self._catch_up(seq)
            if seq.num_computed + 1 > (len(seq.blocks) + seq.unhashed) * block_size:
                needs += 1
        if needs > cache.free_blocks:
            for seq in due:  # preemption ahead: the general pass handles it
                heapq.heappush(heap, (now, seq.order, seq))
            return None
        running = self._running
        if self._rids is None:
            self._rids = [seq.request.request_id for seq in running]
        result = StepResult(duration=0.0, tokens=list(self._rids))
        count = len(running)
        context_after = self._decode_context + count
        for seq in due:
            end = seq.num_computed + 1
            if end > (len(seq.blocks) + seq.unhashed) * block_size:
                cache.allocate(1)
                seq.unhashed += 1
            if end // block_size > len(seq.blocks):
                self._cache_full_blocks(seq, end)
        finished_context = 0
        for seq in due:
            seq.num_computed += 1
            seq.num_output += 1
            seq.num_tokens += 1
            seq.base = now + 1
            if seq.num_output >= seq.max_tokens:
                rid = seq.request.request_id
                result.finished.append(rid)
                finished_context += seq.num_computed
                self._release(seq)
                del self._seqs[rid]
                seq.num_computed = -1
            else:
                heapq.heappush(heap, (self._next_event(seq), seq.order, seq))
        if result.finished:
            self._running = [seq for seq in running if seq.num_computed >= 0]
            self._rids = None
        self._decode_context = context_after - finished_context
        self._pass = now + 1
        result.duration = self.timing.step_time(0, count, context_after, 0.0)
        result.events = cache.events
        cache.events = []
        if not self._running:
            self._lockstep = False
        return result

    # -- execution -----------------------------------------------------------------------------------------

    def _execute(self, scheduled: Sequence[tuple[_Seq, int]], result: StepResult) -> float:
        prefill_tokens = 0
        decode_seqs = 0
        context = 0
        attention = 0.0
        finished = False
        tokens = result.tokens
        for seq, new in scheduled:
            before = seq.num_computed
            if new == 1 and seq.num_output and before == seq.num_tokens - 1:
                decode_seqs += 1
            else:
                prefill_tokens += new
                attention += new * (before + new / 2)
            after = before + new
            context += after
            seq.num_computed = after
            if after == seq.num_tokens:
                rid = seq.request.request_id
                if seq.num_output == 0:
                    result.first_tokens.append(rid)
                seq.num_output += 1
                seq.num_tokens += 1
                tokens.append(rid)
                if seq.num_output >= seq.max_tokens:
                    result.finished.append(rid)
                    self._release(seq)
                    del self._seqs[rid]
                    seq.num_computed = -1
                    finished = True
        if finished:
            self._running = [seq for seq in self._running if seq.num_computed >= 0]
        return self.timing.step_time(prefill_tokens, decode_seqs, context, attention)
