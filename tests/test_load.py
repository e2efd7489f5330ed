from kvrouter.routing.load import EngineGauges, LoadBook, OwnLoad, PeerRise
from kvrouter.typedefs import ReplicaName

A = ReplicaName("a")


def test_ticket_lifecycle_moves_prefill_to_decode_and_releases_once() -> None:
    book = LoadBook()
    ticket = book.begin(A, 300)
    assert book.snapshot(A).in_flight == 1
    assert book.snapshot(A).pending_prefill_tokens == 300
    book.first_token(ticket)
    book.first_token(ticket)
    load = book.snapshot(A)
    assert (load.pending_prefill_tokens, load.decode_requests, load.in_flight) == (0, 1, 1)
    book.finish(ticket)
    book.finish(ticket)
    load = book.snapshot(A)
    assert (load.pending_prefill_tokens, load.decode_requests, load.in_flight) == (0, 0, 0)


def test_finish_before_first_token_releases_prefill() -> None:
    book = LoadBook()
    first = book.begin(A, 100)
    book.begin(A, 50)
    book.finish(first)
    assert book.snapshot(A).pending_prefill_tokens == 50
    assert book.in_flight_total() == 1


def test_engine_gauges_merge_and_clear() -> None:
    book = LoadBook()
    assert book.snapshot(A).engine_waiting is None
    book.observe_engine(A, EngineGauges(waiting=3, running=7, kv_usage=0.5))
    load = book.snapshot(A)
    assert (load.engine_waiting, load.engine_running, load.kv_usage) == (3, 7, 0.5)
    book.observe_engine(A, None)
    assert book.snapshot(A).kv_usage is None


def test_peer_reports_add_to_the_snapshot_and_replace_each_other() -> None:
    book = LoadBook()
    book.begin(A, 100)
    book.fold_peer("p1", A, OwnLoad(in_flight=2, pending_prefill_tokens=500, decode_requests=1))
    book.fold_peer("p2", A, OwnLoad(in_flight=1, pending_prefill_tokens=0, decode_requests=1))
    load = book.snapshot(A)
    assert (load.in_flight, load.pending_prefill_tokens, load.decode_requests) == (4, 600, 2)
    assert load.peer_pending_prefill_tokens == 500
    # Reports are absolute: the next one from p1 replaces its last, it does not add to it.
    book.fold_peer("p1", A, OwnLoad(in_flight=1, pending_prefill_tokens=200, decode_requests=0))
    load = book.snapshot(A)
    assert (load.in_flight, load.pending_prefill_tokens, load.decode_requests) == (3, 300, 1)
    book.drop_peer("p1")
    book.drop_peer("p1")
    load = book.snapshot(A)
    assert (load.in_flight, load.pending_prefill_tokens, load.peer_pending_prefill_tokens) == (2, 100, 0)
    assert book.peers() == ["p2"]
    # What this instance publishes is its own part only.
    assert book.own() == {A: OwnLoad(1, 100, 0)}
    assert book.in_flight_total() == 1 and book.peer_in_flight() == 1


def test_a_peer_report_returns_its_rise_in_requests_and_prefill_tokens() -> None:
    book = LoadBook()
    assert book.fold_peer("p1", A, OwnLoad(2, 700, 0)) == PeerRise(2, 700)
    # Another dispatch (300 tokens) and a first token (200 of the 700) since: the rise is net of the fall.
    assert book.fold_peer("p1", A, OwnLoad(3, 800, 1)) == PeerRise(1, 100)
    assert book.fold_peer("p1", A, OwnLoad(1, 0, 1)) == PeerRise(0, 0)  # falls are not rises
    assert book.fold_peer("p1", A, OwnLoad(1, 0, 1)) == PeerRise(0, 0)  # a repeated report adds nothing
