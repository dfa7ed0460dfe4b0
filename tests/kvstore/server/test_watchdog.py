"""The daemon's watchdog (kvstore.server.watchdog): what fires, what does not, and when it stops.

Deadlines here are either short with a generous wait for them to fire, or long against a
short look: the checks do not depend on how fast this machine is.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvstore.server.watchdog import Watchdog


@pytest.fixture()
def dog():
    w = Watchdog()
    yield w
    w.close()


def test_fires_once_after_its_time(dog) -> None:
    fired = []
    ev = threading.Event()
    dog.arm("a", 0.05, lambda: (fired.append(1), ev.set()))
    assert ev.wait(5)
    time.sleep(0.2)
    assert fired == [1]


def test_disarmed_or_rearmed_tokens_do_not_fire(dog) -> None:
    fired = []
    dog.arm("gone", 1.0, lambda: fired.append("gone"))
    dog.disarm("gone")
    dog.arm("later", 1.0, lambda: fired.append("first"))
    dog.arm("later", 60.0, lambda: fired.append("second"))  # restarts the wait
    dog.disarm("never armed")
    time.sleep(1.5)
    assert fired == []


def test_an_earlier_deadline_wakes_a_thread_waiting_on_a_later_one(dog) -> None:
    ev = threading.Event()
    dog.arm("far", 60.0, lambda: None)
    time.sleep(0.05)  # the thread now waits on "far"
    dog.arm("near", 0.05, ev.set)
    assert ev.wait(5)


def test_a_failing_callback_is_logged_and_the_rest_still_fire(dog, caplog) -> None:
    ev = threading.Event()

    def boom() -> None:
        raise RuntimeError("boom")

    dog.arm("bad", 0.01, boom)
    dog.arm("good", 0.02, ev.set)
    assert ev.wait(5)
    dog.arm("after", 0.01, ev.clear)  # the thread survived the failure
    deadline = time.monotonic() + 5
    while ev.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not ev.is_set()
    assert "watchdog callback failed" in caplog.text


def test_close_stops_the_thread_and_nothing_fires_after() -> None:
    w = Watchdog()
    fired = []
    w.arm("a", 0.3, lambda: fired.append(1))
    w.close()
    assert not w._thread.is_alive()
    time.sleep(0.5)
    assert fired == []
