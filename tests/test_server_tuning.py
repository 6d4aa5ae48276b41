"""queued.server.tuning: what `queued serve` sets in its own process (in a child process
here: the settings are process-wide and for good)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

from queued.server import tuning

PROBE = """
import gc, json
from queued.server.tuning import tune_process
before = gc.get_threshold()
tune_process()
print(json.dumps([before, gc.get_threshold()]))
"""


def test_tune_process_sets_the_servers_gc_thresholds_and_only_in_its_process() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    before, after = json.loads(out)
    assert tuple(after) == tuning.GC_THRESHOLDS != tuple(before)
    assert gc.get_threshold() != tuning.GC_THRESHOLDS  # importing the module changes nothing

