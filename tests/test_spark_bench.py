"""The Spark benchmarks (bench/spark_bench.py, bench/spark_write_bench.py's Spark phases) run
in a smoke mode, in this process, on the suite's SparkSession: a JVM of their own would
cost more than every other smoke run together (tests/test_bench.py has those). Asserts that
each run completes and reports its figures, never their values, and that the session the
benchmarks were handed still works afterwards.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_spark_benchmarks(spark: Any, capsys: pytest.CaptureFixture[str],
                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import spark_bench
    import spark_write_bench

    monkeypatch.setattr(sys, "argv", ["spark_bench.py", "--mb", "1", "--write-rows", "200"])
    spark_bench.main()
    out = capsys.readouterr().out
    assert re.search(r"journal/parquet rows/s ratio: [0-9.]+", out), out
    assert re.search(r"writer: 200 rows of 200 B in [0-9.]+ s", out), out
    monkeypatch.setattr(sys, "argv", ["spark_write_bench.py", "--rows", "500", "--repeat", "1",
                                      "--skip-bare"])
    spark_write_bench.main()
    out = capsys.readouterr().out
    assert re.search(r"spark, queue column \(4 queues\) +[0-9,]+ rows/s", out), out
    assert spark.range(3).count() == 3  # the suite's session still runs
