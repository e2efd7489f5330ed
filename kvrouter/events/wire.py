"""vLLM KV-cache events: the wire format decoded once, at the edge, into small typed values.

A vLLM publisher sends ZMQ multipart messages `[topic, seq, payload]`: `seq` is 8 bytes big-endian, `payload` is
msgpack `[ts, events, data_parallel_rank]` (older engines omit the rank). vLLM >= 0.24 encodes each event as a
map tagged by `"type"` with default-valued fields left out; vLLM <= 0.23 encodes it as an array whose first
element is the tag. Engine block hashes are uint64 ints, or bytes digests (folded here to their low 64 bits, the
same fold vLLM uses for its int form). Unknown fields and trailing array elements are ignored, so newer engines
keep decoding. Each event is decoded on its own: one bad event is reported as a `DecodeProblem` and the rest of
the batch still counts.

The values produced here (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, `EventBatch`) are what every
consumer sees — the index ingest and the Redis relay alike; they are msgspec structs, so they re-encode cheaply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from kvrouter.typedefs import EngineBlockHash, Tier

_HASH_MASK = (1 << 64) - 1
SEQ_END = (1 << 64) - 1
"""The replay socket's end marker: seq -1 as 8 unsigned bytes."""

WireHash = int | bytes


# ---- normalised values --------------------------------------------------------------------------------------


class BlockStored(msgspec.Struct, frozen=True, gc=False, tag=True):
    """Full blocks an engine just cached: `token_ids` covers all of them, `parent` is the block before the first."""

    engine_hashes: list[EngineBlockHash]
    parent: EngineBlockHash | None
    token_ids: list[int]
    block_size: int
    tier: Tier = Tier.GPU
    lora_name: str | None = None
    lora_id: int | None = None
    extra_keys: list[Any] | None = None
    """Per block: None or the engine's extra hash inputs (LoRA name, multimodal hashes, cache salt)."""
    group_idx: int | None = None
    spec_kind: str | None = None


class BlockRemoved(msgspec.Struct, frozen=True, gc=False, tag=True):
    engine_hashes: list[EngineBlockHash]
    tier: Tier = Tier.GPU
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False, tag=True):
    """Every block of the engine (this DP rank) is gone: prefix cache reset, or the engine restarted."""

    restart: bool = False
    """True when kvrouter inferred it from the sequence number going backwards, not from the engine."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    """One engine message: what one scheduler step changed on one DP rank of one replica."""

    replica: str
    dp_rank: int
    seq: int
    ts: float
    events: list[KvEvent]


class DecodeProblem(msgspec.Struct, frozen=True, gc=False):
    """An event (or frame) that could not be decoded; counted by `kind` and `reason`, then skipped."""

    kind: str
    """The event type if it could be read, else "frame" or "unknown"."""
    reason: str
    detail: str = ""


# ---- the wire shapes ----------------------------------------------------------------------------------------


class _MapStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[WireHash]
    token_ids: list[int]
    block_size: int
    parent_block_hash: WireHash | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _MapRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[WireHash]
    medium: str | None = None
    group_idx: int | None = None


class _MapCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _ArrayStored(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _ArrayRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[WireHash]
    medium: str | None = None
    group_idx: int | None = None


class _ArrayCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


_MapEvent = _MapStored | _MapRemoved | _MapCleared
_ArrayEvent = _ArrayStored | _ArrayRemoved | _ArrayCleared
_WireEvent = _MapEvent | _ArrayEvent
_MAP_MARKERS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
_KNOWN_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def _fold(value: WireHash) -> EngineBlockHash:
    if isinstance(value, bytes):
        return EngineBlockHash(int.from_bytes(value, "big") & _HASH_MASK)
    return EngineBlockHash(value & _HASH_MASK)


def _fold_all(values: list[WireHash]) -> list[EngineBlockHash]:
    # vLLM's usual form (non-negative ints) passes through without a per-hash Python step: `min` over ints is
    # one C-level pass, and bytes (alone or mixed with ints) make the comparison raise instead.
    try:
        if not values or min(values) >= 0:  # type: ignore[operator]
            return values  # type: ignore[return-value]
    except TypeError:
        pass
    return [_fold(h) for h in values]


_COMMON_MEDIA: dict[str | None, Tier] = {None: Tier.GPU, "GPU": Tier.GPU, "CPU": Tier.CPU}


def _tier(medium: str | None) -> Tier:
    tier = _COMMON_MEDIA.get(medium)
    return Tier.from_medium(medium) if tier is None else tier


def _normalise(event: _WireEvent) -> KvEvent:
    if isinstance(event, _MapStored | _ArrayStored):
        parent = event.parent_block_hash
        # Positional: this runs once per stored event on the ingest hot path (keywords cost more).
        return BlockStored(
            _fold_all(event.block_hashes),
            None if parent is None else _fold(parent),
            event.token_ids,
            event.block_size,
            _tier(event.medium),
            event.lora_name,
            event.lora_id,
            event.extra_keys,
            event.group_idx,
            event.kv_cache_spec_kind,
        )
    if isinstance(event, _MapRemoved | _ArrayRemoved):
        return BlockRemoved(_fold_all(event.block_hashes), _tier(event.medium), event.group_idx)
    return AllBlocksCleared()


class _Payload(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _MapPayload(msgspec.Struct, array_like=True, gc=False):
    """The whole payload of a vLLM >= 0.24 engine in one decode; anything else takes the per-event path."""

    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


class WireDecoder:
    """Decodes payloads into `EventBatch`es; one instance per consumer (msgspec decoders are not shared state)."""

    def __init__(self) -> None:
        self._payload = msgspec.msgpack.Decoder(_Payload)
        self._map_payload = msgspec.msgpack.Decoder(_MapPayload)
        self._map_event = msgspec.msgpack.Decoder(_MapEvent)
        self._array_event = msgspec.msgpack.Decoder(_ArrayEvent)
        self._peek = msgspec.msgpack.Decoder(Any)

    def decode_payload(self, replica: str, seq: int, payload: bytes) -> tuple[EventBatch | None, list[DecodeProblem]]:
        """The batch (None when the payload itself is unreadable) and the problems met on the way."""
        try:
            whole = self._map_payload.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        else:
            normalised = [_normalise(event) for event in whole.events]
            return EventBatch(replica, whole.data_parallel_rank or 0, seq, whole.ts, normalised), []
        try:
            raw = self._payload.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            return None, [DecodeProblem("frame", "bad_payload", str(error))]
        events: list[KvEvent] = []
        problems: list[DecodeProblem] = []
        for item in raw.events:
            try:
                first = memoryview(item)[0] if len(item) else 0
                decoder = self._map_event if first in _MAP_MARKERS else self._array_event
                events.append(_normalise(decoder.decode(item)))
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                problems.append(self._problem(item, error))
        rank = raw.data_parallel_rank or 0
        return EventBatch(replica, rank, seq, raw.ts, events), problems

    def _problem(self, item: msgspec.Raw, error: Exception) -> DecodeProblem:
        kind = "unknown"
        try:
            value = self._peek.decode(item)
        except msgspec.DecodeError:
            value = None
        tag = value.get("type") if isinstance(value, dict) else value[0] if isinstance(value, list) and value else None
        if isinstance(tag, str) and tag in _KNOWN_TYPES:
            kind = tag
            reason = "bad_event"
        elif tag is None:
            reason = "bad_event"
        else:
            reason = "unknown_type"
        return DecodeProblem(kind, reason, str(error))


def decode_seq(frame: bytes) -> int | None:
    if len(frame) != 8:
        return None
    return int.from_bytes(frame, "big")


def encode_seq(seq: int) -> bytes:
    return (seq & SEQ_END).to_bytes(8, "big")


def split_frames(frames: Sequence[bytes]) -> tuple[bytes, bytes, bytes] | None:
    """(topic, seq, payload) of a published message; a message without a topic frame gets topic b""."""
    if len(frames) == 3:
        return frames[0], frames[1], frames[2]
    if len(frames) == 2:
        return b"", frames[0], frames[1]
    return None


def split_replay_reply(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of a replay-socket reply, as a DEALER or REQ receives it; None when malformed.

    Newer vLLM answers a DEALER with `[b"", topic, seq, payload]`, vLLM <= 0.25 with `[b"", seq, payload]`; a
    REQ socket sees the same without the empty delimiter. The end of a replay has seq == `SEQ_END`.
    """
    if len(frames) == 4:
        seq_frame, payload = frames[2], frames[3]
    elif len(frames) == 3:
        seq_frame, payload = frames[1], frames[2]
    elif len(frames) == 2:
        seq_frame, payload = frames[0], frames[1]
    else:
        return None
    seq = decode_seq(seq_frame)
    return None if seq is None else (seq, payload)


__all__ = [
    "SEQ_END",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodeProblem",
    "EventBatch",
    "KvEvent",
    "WireDecoder",
    "decode_seq",
    "encode_seq",
    "split_frames",
    "split_replay_reply",
]
