"""The bench harness: every benchmark in bench/ starts its servers, takes its readings and
keeps its output through this package (scripts run as `python bench/x.py`, so bench/ is on
sys.path, in spawned workers too, and `import benchlib` finds it).

- servers.py: `queued serve` (any build, config, flags, TLS), started and stopped by PID
  in one place; peers.py: darner and redis-server, on the same base;
- measure.py: latency histograms, CPU (user and system, from /proc) and RSS readings, an
  RSS sampler;
- results.py: a run's output kept outside git (bench/results/, or $QUEUED_BENCH_RESULTS);
- spark.py: the SparkSession of the Spark benchmarks.
"""

from __future__ import annotations

from .measure import (
    CLK_TCK,
    CpuWindow,
    RssSampler,
    bucket,
    hwm_kib,
    kib_field,
    merge_hist,
    percentiles,
    proc_cpu,
    proc_cpu_s,
    rss_kib,
    system_busy_s,
)
from .peers import (
    DARNER,
    DARNER_BUILD,
    PEERS,
    DarnerServer,
    RedisServer,
    ensure_darner,
    redis_available,
    resp_command,
)
from .results import (
    measured_tree,
    recording,
    result_file,
    result_stem,
    results_dir,
    tree_commit,
)
from .servers import (
    HOST,
    QUEUED,
    QUEUED_CMD,
    BenchCerts,
    MemcacheServer,
    QueuedServer,
    Server,
    free_port,
    queued_available,
    start_server,
    stop_all,
    tls_connect,
)
from .spark import spark_done, spark_session

__all__ = [
    "CLK_TCK", "DARNER", "DARNER_BUILD", "HOST", "PEERS", "QUEUED", "QUEUED_CMD", "BenchCerts",
    "CpuWindow", "DarnerServer", "MemcacheServer", "QueuedServer", "RedisServer", "RssSampler",
    "Server", "bucket", "ensure_darner", "free_port", "hwm_kib", "kib_field", "measured_tree",
    "merge_hist", "percentiles", "proc_cpu", "proc_cpu_s", "queued_available", "recording",
    "redis_available", "resp_command", "result_file", "result_stem", "results_dir", "rss_kib",
    "spark_done", "spark_session", "start_server", "stop_all", "system_busy_s", "tls_connect",
    "tree_commit",
]
