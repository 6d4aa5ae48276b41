"""queued.server.tuning: what `queued serve` sets in its own process (in a child process
here: the settings are process-wide and for good)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

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

