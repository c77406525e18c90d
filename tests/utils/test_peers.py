"""utils/peers.py: ranks of one job watching each other through a TCPStore (two or three
`Peers` in this process, each as one rank would hold it): silence, recorded exits, stop
requests and meets. Each wait is bounded as a hang check; none is a speed target."""
import socket
import threading
import time

import pytest
import torch.distributed as dist

from minisparse.utils.peers import FINISHED, Loss, Peers

TIMEOUT_S, INTERVAL_S = 1.5, 0.1


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def ranks(store, world: int = 2) -> list[Peers]:
    """One Peers per rank, each recording what it is told."""
    peers = [Peers(store, r, world, TIMEOUT_S, INTERVAL_S) for r in range(world)]
    for p in peers:
        p.told = {"lost": [], "stop": []}
        p.on_lost = p.told["lost"].append
        p.on_stop = p.told["stop"].append
    return peers


def until(condition, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "not within the hang limit"
        time.sleep(0.02)


def test_a_rank_whose_heartbeat_stops_is_lost_after_the_timeout(store):
    a, b = ranks(store)
    a.start(), b.start()
    until(lambda: a._counts[1] is not None)  # a has heard b
    b.close()  # frozen: no more heartbeats, nothing recorded
    until(lambda: a.told["lost"])
    (loss,) = a.told["lost"]
    assert (loss.rank, loss.host) == (1, socket.gethostname())
    assert loss.why.startswith("went silent: no heartbeat for ")
    assert a.lost == loss and b.told["lost"] == []
    a.close()


def test_a_rank_that_records_an_error_is_lost_at_once_and_a_finished_one_is_not(store):
    a, b, c = ranks(store, 3)
    for p in (a, b, c):
        p.start()
    c.leave(FINISHED)  # its run is over, its heartbeat stops: the others go on
    c.close()
    until(lambda: a.departed == {2})
    time.sleep(TIMEOUT_S + 5 * INTERVAL_S)  # longer than a silence that would count
    assert a.told["lost"] == []
    b.leave("stopped with an error (ValueError: no)")
    until(lambda: a.told["lost"])
    why = "stopped with an error (ValueError: no)"
    assert a.told["lost"] == [Loss(1, socket.gethostname(), why)]
    a.close(), b.close()


def test_a_stop_posted_by_one_rank_reaches_every_rank_once(store):
    a, b = ranks(store)
    a.start(), b.start()
    b.post_stop(15)
    a.post_stop(2)  # the first request stands
    until(lambda: a.told["stop"] and b.told["stop"])
    time.sleep(5 * INTERVAL_S)
    assert a.told["stop"] == [15] and b.told["stop"] == [15]
    a.close(), b.close()


def meet_in_thread(peers: Peers, leaving=lambda: None) -> dict:
    result = {}

    def run():
        try:
            peers.meet(leaving)
            result["met"] = True
        except BaseException as exc:  # what meet raised
            result["raised"] = exc

    result["thread"] = threading.Thread(target=run)
    result["thread"].start()
    return result


def test_a_meet_returns_once_every_rank_has_come(store):
    a, b = ranks(store)
    first = meet_in_thread(a)
    time.sleep(0.2)
    assert "met" not in first  # b has not come
    b.meet(lambda: None)
    first["thread"].join(timeout=30)
    assert first.get("met") and a.meets == b.meets == 1


def test_a_rank_asked_to_stop_leaves_a_meet_taking_its_arrival_back(store):
    """A meet that completed without a rank that left it would start a collective that
    rank never joins; taken back, the next meet on every rank is the same one."""
    a, b = ranks(store)
    stop = KeyboardInterrupt("stop")
    asked = threading.Event()
    left = meet_in_thread(a, lambda: stop if asked.is_set() else None)
    time.sleep(0.2)
    asked.set()
    left["thread"].join(timeout=30)
    assert left.get("raised") is stop and a.meets == 0
    # the same meet, now with both: it completes, neither waits for a third arrival
    again = meet_in_thread(a)
    b.meet(lambda: None)
    again["thread"].join(timeout=30)
    assert again.get("met") and a.meets == b.meets == 1


def test_a_rank_waiting_in_a_meet_for_one_that_left_is_told(store):
    a, b = ranks(store)
    b.leave(FINISHED)
    waiting = meet_in_thread(a)
    until(lambda: a.told["lost"])
    assert a.told["lost"][0].rank == 1
    assert a.told["lost"][0].why == "left the run while this rank waited for it"
    b.meet(lambda: None)  # let the thread go
    waiting["thread"].join(timeout=30)


def test_a_stopping_rank_meets_apart_from_one_that_has_not_heard_yet(store):
    """A rank that dropped its rollout meets the others for its save; one still waiting in
    the rollout's meet must not take that for its own (a collective against another)."""
    a, b = ranks(store)
    heard = threading.Event()
    waiting = meet_in_thread(a, lambda: KeyboardInterrupt("stop") if heard.is_set() else None)
    b.stopping()
    saving = meet_in_thread(b)
    time.sleep(0.3)
    assert "met" not in waiting and "met" not in saving
    heard.set()  # a hears of the stop: it leaves its meet and stops too
    waiting["thread"].join(timeout=30)
    assert isinstance(waiting.get("raised"), KeyboardInterrupt)
    a.stopping()
    a.meet(lambda: None)
    saving["thread"].join(timeout=30)
    assert saving.get("met") and a.meets == b.meets == 1
