"""The hang watchdog in one process: it fires after the timeout (stretched for slow parts), names
where it waited and which peer fell behind, from the progress the peers posted to the store."""
from __future__ import annotations

import json
import time

from shardfit.train.watchdog import Watchdog


class Store:
    """The three calls the watchdog makes on torch's c10d store, on a dict."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def test_fires_and_names_the_stuck_rank():
    store = Store()
    peer = Watchdog(1, 3, 0.6, store, exit_process=False)
    with peer.watch(3, "forward/backward 1/1 (gradient all_reduce)"):
        pass  # rank 1 finished its backward, then went silent
    store.set("shardfit/progress/rank-2", json.dumps({"step": 3, "what": "all_reduce(loss)", "state": "in",
                                                      "t": time.time() + 60}))  # rank 2: alive, waiting too
    dog = Watchdog(0, 3, 0.6, store, exit_process=False)
    started = time.monotonic()
    with dog.watch(3, "all_reduce(loss)"):
        while dog.fired is None and time.monotonic() - started < 5:
            time.sleep(0.05)
    assert dog.fired is not None and 0.6 <= time.monotonic() - started < 3
    assert dog.fired.startswith("shardfit: error: hang: rank 0 waited")
    assert "in step 3 all_reduce(loss)" in dog.fired
    assert "rank 1 is stuck after step 3 forward/backward 1/1 (gradient all_reduce)" in dog.fired
    assert "rank 2" not in dog.fired  # recently heard from: not the culprit


def test_quiet_when_in_time_and_scaled_for_slow_parts():
    dog = Watchdog(0, 2, 0.5, None, exit_process=False)
    with dog.watch(1, "all_reduce(loss)"):
        time.sleep(0.2)
    with dog.watch(1, "checkpoint save", scale=4):
        time.sleep(1.0)  # over the plain timeout, within the stretched one
    time.sleep(0.6)  # outside any watched part: never a hang
    assert dog.fired is None
    off = Watchdog(0, 2, None, None, exit_process=False)
    with off.watch(1, "anything"):
        time.sleep(0.1)
    assert off.fired is None and off._thread is None
