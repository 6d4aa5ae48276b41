"""queued.server.tuning: what `queued serve` sets in its own process (in a child process
here: the settings are process-wide and for good), and that `queued serve` does it."""

from __future__ import annotations

import gc
import json
import re
import signal
import subprocess
import sys
import time

import pytest
from server_util import ServerProcess, pymc

from queued.server import tuning

PROBE = """
import gc, json, sys
from queued.server.tuning import tune_process
before = [gc.get_threshold(), sys.getswitchinterval()]
tune_process()
print(json.dumps([before, [gc.get_threshold(), sys.getswitchinterval()]]))
"""


def test_tune_process_sets_the_servers_settings_and_only_in_its_process() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    (gc_before, switch_before), (gc_after, switch_after) = json.loads(out)
    assert tuple(gc_after) == tuning.GC_THRESHOLDS != tuple(gc_before)
    assert switch_after == pytest.approx(tuning.SWITCH_INTERVAL)
    assert switch_before > 2 * tuning.SWITCH_INTERVAL
    # importing the module changes nothing
    assert gc.get_threshold() != tuning.GC_THRESHOLDS
    assert sys.getswitchinterval() != pytest.approx(tuning.SWITCH_INTERVAL)



FREEZE_PROBE = """
import gc, json
from queued.server.tuning import freeze_startup_heap
before = gc.get_freeze_count()
frozen = freeze_startup_heap()
print(json.dumps([before, frozen, gc.get_freeze_count()]))
"""


def test_freeze_startup_heap_leaves_every_tracked_object_to_the_permanent_generation(
) -> None:
    out = subprocess.run([sys.executable, "-c", FREEZE_PROBE], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    before, frozen, after = json.loads(out)
    assert before == 0 and frozen == after > 1000  # (the interpreter's own, at least)


def test_queued_serve_freezes_its_heap_once_serving_and_serves_on(
        server_proc: ServerProcess) -> None:
    """The freeze comes after the listeners are up (the start-up's objects are made by
    then); the server then serves and stops cleanly as before."""
    server_proc.start()
    deadline = time.monotonic() + 10
    while b"start-up heap:" not in server_proc.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    found = re.search(rb"start-up heap: (\d+) objects left out of garbage collections",
                      server_proc.log())
    assert found is not None, server_proc.log()
    assert int(found[1]) > 10_000
    client = pymc(server_proc.memcache)
    try:
        assert client.set("q", b"after the freeze")
        assert client.get("q") == b"after the freeze"
    finally:
        client.close()
    server_proc.signal(signal.SIGTERM)
    assert server_proc.wait() == 0
    assert b"stopped cleanly" in server_proc.log()
