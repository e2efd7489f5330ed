from kvrouter.routing.load import EngineGauges, LoadBook
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
