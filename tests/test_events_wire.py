"""Decoding vLLM's KV-event wire format: every captured frame, replay replies, old array events, bad input."""

from __future__ import annotations

import json

import msgspec
import pytest

from kvrouter.events.wire import (
    SEQ_END,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireDecoder,
    decode_seq,
    encode_seq,
    split_frames,
    split_replay_reply,
)
from kvrouter.typedefs import Tier
from tests.vllm_captures import CAPTURES, frame_dirs, messages, replay_replies


def _decoded_reference(frames_dir_name: str, run_dir: object) -> list[dict[str, object]]:
    from pathlib import Path

    run = Path(str(run_dir))
    suffix = frames_dir_name.removeprefix("frames")
    path = run / f"decoded{suffix}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _plain_hash(value: object) -> int:
    if isinstance(value, dict):
        return int(value["__bytes_hex__"], 16) & (2**64 - 1)
    assert isinstance(value, int)
    return value


@pytest.mark.parametrize("frames_dir", frame_dirs(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_captured_frame_decodes_like_a_plain_msgpack_reading(frames_dir: object) -> None:
    from pathlib import Path

    folder = Path(str(frames_dir))
    captured = messages(folder)  # first: it skips (fails under CI) when the captures are missing
    reference = _decoded_reference(folder.name, folder.parent)
    decoder = WireDecoder()
    assert len(captured) == len(reference) > 0
    for message, expected in zip(captured, reference, strict=True):
        parts = split_frames(message.frames)
        assert parts is not None
        topic, seq_frame, payload = parts
        assert topic.decode() == expected["topic"]
        assert decode_seq(seq_frame) == expected["seq"]
        batch, problems = decoder.decode_payload("r", expected["seq"], payload)  # type: ignore[arg-type]
        assert problems == []
        assert batch is not None
        assert batch.dp_rank == expected["data_parallel_rank"]
        assert batch.ts == expected["ts"]
        events = expected["events"]
        assert isinstance(events, list)
        assert len(batch.events) == len(events)
        for event, plain in zip(batch.events, events, strict=True):
            assert type(event).__name__ == plain["type"]
            if isinstance(event, BlockStored | BlockRemoved):
                assert event.engine_hashes == [_plain_hash(h) for h in plain["block_hashes"]]
                assert event.tier == Tier.GPU
            if isinstance(event, BlockStored):
                assert event.token_ids == plain["token_ids"]
                assert event.block_size == plain["block_size"]
                assert len(event.token_ids) == len(event.engine_hashes) * event.block_size
                parent = plain.get("parent_block_hash")
                assert event.parent == (None if parent is None else _plain_hash(parent))


def test_data_parallel_ranks_keep_their_own_rank_and_sequence() -> None:
    decoder = WireDecoder()
    for rank in (0, 1):
        folder = CAPTURES / "runs" / "s7_dp2" / f"frames_rank{rank}"
        seqs = []
        for message in messages(folder):
            _, seq_frame, payload = message.frames
            seq = decode_seq(seq_frame)
            assert seq is not None
            batch, _ = decoder.decode_payload("dp", seq, payload)
            assert batch is not None and batch.dp_rank == rank
            seqs.append(seq)
        assert seqs == list(range(len(seqs)))


def test_replay_replies_from_a_dealer_and_a_req_socket() -> None:
    decoder = WireDecoder()
    dealer = [split_replay_reply(frames) for frames in replay_replies("dealer")]
    assert [r[0] for r in dealer if r is not None] == [2, 3, 4, 5, SEQ_END]
    for reply in dealer[:-1]:
        assert reply is not None
        batch, problems = decoder.decode_payload("r", reply[0], reply[1])
        assert batch is not None and not problems and batch.events
    req = [split_replay_reply(frames) for frames in replay_replies("req")]
    assert req[0] is not None and req[0][0] == 0
    batch, _ = decoder.decode_payload("r", 0, req[0][1])
    assert batch is not None and isinstance(batch.events[0], BlockStored)


def test_old_array_events_and_byte_hashes_and_media() -> None:
    digest = bytes(range(32))
    payload = msgspec.msgpack.encode(
        [
            12.5,
            [
                ["BlockStored", [digest, 7], None, [1, 2, 3, 4], 2, None, "CPU", None, None, 0, "extra-future-field"],
                ["BlockRemoved", [7], "cpu"],
                ["AllBlocksCleared"],
                ["BlockStored", [9], digest, [5, 6], 2, None],
            ],
        ]
    )
    batch, problems = WireDecoder().decode_payload("r", 3, payload)
    assert problems == []
    assert batch is not None and batch.dp_rank == 0 and batch.seq == 3
    stored, removed, cleared, child = batch.events
    folded = int.from_bytes(digest, "big") & (2**64 - 1)
    assert isinstance(stored, BlockStored) and stored.engine_hashes == [folded, 7] and stored.tier == Tier.CPU
    assert isinstance(removed, BlockRemoved) and removed.tier == Tier.CPU and removed.engine_hashes == [7]
    assert isinstance(cleared, AllBlocksCleared)
    assert isinstance(child, BlockStored) and child.parent == folded and child.tier == Tier.GPU


def test_map_events_ignore_unknown_fields_and_keep_storage_tier() -> None:
    event = {
        "type": "BlockStored",
        "block_hashes": [1],
        "token_ids": [1, 2],
        "block_size": 2,
        "medium": "LOCAL_DISK",
        "lora_name": "adapter",
        "some_future_field": {"x": 1},
    }
    batch, problems = WireDecoder().decode_payload("r", 0, msgspec.msgpack.encode([1.0, [event], 1]))
    assert problems == [] and batch is not None
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.tier == Tier.STORAGE and stored.lora_name == "adapter" and batch.dp_rank == 1


def test_bad_events_are_reported_one_by_one_and_the_rest_kept() -> None:
    good = {"type": "BlockRemoved", "block_hashes": [1]}
    events = [good, {"type": "BlockStored", "block_hashes": "nope"}, {"type": "Mystery"}, 42, ["BlockStored"]]
    batch, problems = WireDecoder().decode_payload("r", 0, msgspec.msgpack.encode([1.0, events, 0]))
    assert batch is not None and len(batch.events) == 1
    assert [(p.kind, p.reason) for p in problems] == [
        ("BlockStored", "bad_event"),
        ("unknown", "unknown_type"),
        ("unknown", "bad_event"),
        ("BlockStored", "bad_event"),
    ]


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode([1])])
def test_unreadable_payloads_are_a_frame_problem(payload: bytes) -> None:
    batch, problems = WireDecoder().decode_payload("r", 0, payload)
    assert batch is None and [(p.kind, p.reason) for p in problems] == [("frame", "bad_payload")]


def test_frames_and_sequence_numbers() -> None:
    assert split_frames([b"t", b"s", b"p"]) == (b"t", b"s", b"p")
    assert split_frames([b"s", b"p"]) == (b"", b"s", b"p")
    assert split_frames([b"p"]) is None
    assert decode_seq(encode_seq(2**40 + 5)) == 2**40 + 5
    assert decode_seq(b"\x00" * 7) is None
    assert encode_seq(-1) == b"\xff" * 8
    assert split_replay_reply([b"", encode_seq(4), b"p"]) == (4, b"p")  # vLLM <= 0.25, no topic frame
    assert split_replay_reply([b"", b"topic", encode_seq(4), b"p"]) == (4, b"p")
    assert split_replay_reply([b"", b"topic", b"bad", b"p"]) is None
