"""The deploy/ directory: example config, compose, Prometheus, Grafana and Kubernetes files.

Every YAML / JSON / TOML file under deploy/ must parse (the directory is walked, so new
files are covered). The files must agree with the server: ports and data directory with
ServerConfig's defaults, probe paths with the HTTP port's routes, QUEUED_* variables with
the config keys, metric names in the dashboard and alert rules with the exporter's contract
(METRICS below) and, against a real server, with what /metrics really exposes.
promtool, when installed, checks the Prometheus files and runs the alert unit tests.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml
from server_util import HOST, WAIT, Conn, make_config, running

from queued.config import (
    CONFIG_ENV,
    QUEUE_KEYS,
    SERVER_KEYS,
    ServerConfig,
    env_var,
    load_config,
)
from queued.config.users import UsersError, load_users
from queued.server.app import check_exposure
from queued.server.http import ROUTES

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
EXAMPLE = DEPLOY / "queued.example.toml"
COMPOSE = DEPLOY / "compose.yaml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERT_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "queued.json"
GRAFANA_PROVISIONING = DEPLOY / "grafana" / "provisioning"
K8S = DEPLOY / "k8s"

DEFAULTS = load_config({}, env={})
DATA_DIR = "/var/lib/queued"  # the data directory in the container
PORTS = {
    "memcache": DEFAULTS.memcache_port,
    "text": DEFAULTS.text_port,
    "rpc": DEFAULTS.rpc_port,
    "http": DEFAULTS.http_port,
}
PROBE_PATHS = {"/livez", "/readyz"}
#: Server keys that default to unset: the example shows them commented out.
OPTIONAL_KEYS = {"archive_dir", "expire_to_queue", "error_queue", "tls_cert", "tls_key",
                 "tls_client_ca", "users_file"}

# -- the exporter's metric names (queued/metrics.py): the contract ----------------------------
#: Labels queue, reader ("" = the queue's own reader).
READER_METRICS = frozenset({
    "queued_queue_items",
    "queued_queue_bytes",
    "queued_queue_memory_bytes",
    "queued_queue_open_reads",
    "queued_queue_waiters",
    "queued_queue_oldest_item_age_seconds",
    "queued_queue_puts_total",
    "queued_queue_gets_total",
    "queued_queue_expired_total",
    "queued_queue_discarded_total",
    "queued_queue_aborted_total",
    "queued_queue_flushes_total",
})
#: Label queue.
JOURNAL_METRICS = frozenset({
    "queued_journal_bytes",
    "queued_journal_segments",
    "queued_journal_failed",
    "queued_journal_fsyncs_total",
    "queued_journal_write_errors_total",
})
HISTOGRAMS = frozenset({
    "queued_fsync_duration_seconds",
    "queued_put_latency_seconds",
    "queued_get_latency_seconds",
    "queued_reactor_pass_seconds",
})
SERVER_METRICS = frozenset({
    # The gauge of open connections is not "queued_connections": in OpenMetrics that is the
    # family name of the counter queued_connections_total.
    "queued_open_connections",
    "queued_connections_total",
    "queued_connections_refused_total",
    "queued_commands_total",
    "queued_protocol_errors_total",
    "queued_bytes_read_total",
    "queued_bytes_written_total",
    "queued_recovery_duration_seconds",
    "queued_recovery_truncated_bytes",
    "queued_recovery_intents_replayed",
    "queued_intent_log_appends_total",
    "queued_intent_log_settles_total",
    "queued_build_info",
    "queued_ready",
    "queued_queues",
    "queued_metrics_omitted_readers",
    "queued_disk_free_bytes",
    "queued_disk_total_bytes",
})
#: prometheus_client's process collector (Linux).
PROCESS_METRICS = frozenset({
    "process_virtual_memory_bytes",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
    "process_cpu_seconds_total",
    "process_open_fds",
    "process_max_fds",
})
METRICS = READER_METRICS | JOURNAL_METRICS | HISTOGRAMS | SERVER_METRICS | PROCESS_METRICS
#: Label names each metric carries (besides job/instance, which Prometheus adds).
METRIC_LABELS: Mapping[str, set[str]] = {
    **{name: {"queue", "reader"} for name in READER_METRICS},
    **{name: {"queue"} for name in JOURNAL_METRICS},
    "queued_open_connections": {"protocol"},
    "queued_connections_total": {"protocol"},
    "queued_connections_refused_total": {"protocol"},
    "queued_commands_total": {"protocol", "command"},
    "queued_protocol_errors_total": {"protocol"},
    "queued_build_info": {"version", "python", "build"},
}
_METRIC_RE = re.compile(r"\b(?:queued|process)_[a-z0-9_]+")
_SERIES_SUFFIXES = ("_bucket", "_sum", "_count")


def base_metric(series: str) -> str:
    """The metric a series name belongs to: a histogram's _bucket/_sum/_count are its own."""
    for suffix in _SERIES_SUFFIXES:
        if series.endswith(suffix) and series.removesuffix(suffix) in HISTOGRAMS:
            return series.removesuffix(suffix)
    return series


# -- reading the files ---------------------------------------------------------------------------


def deploy_files(*suffixes: str) -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in suffixes)


def load_docs(path: Path) -> list[Any]:
    """Every document of a YAML (multi-document), JSON or TOML file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        return [doc for doc in yaml.safe_load_all(text) if doc is not None]
    if path.suffix == ".json":
        return [json.loads(text)]
    return [tomllib.loads(text)]


def load_one(path: Path) -> Any:
    (doc,) = load_docs(path)
    return doc


def strings(node: object) -> Iterator[str]:
    """Every string anywhere in a parsed document."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings(value)


def metrics_in(node: object) -> set[str]:
    return {base_metric(m) for text in strings(node) for m in _METRIC_RE.findall(text)}


def dashboard_exprs(dashboard: Mapping[str, Any]) -> list[str]:
    def panels(items: list[Any]) -> Iterator[Mapping[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    return [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets", [])]


def used_metrics() -> set[str]:
    """Metric names the dashboard and the alert rules use."""
    return metrics_in(load_one(DASHBOARD)) | metrics_in(load_one(ALERTS))


def effective_config(toml: str | None, env: Mapping[str, str], tmp_path: Path) -> ServerConfig:
    """The server's config from a file's text and the QUEUED_* variables of a deployment."""
    flags: dict[str, object] = {}
    if toml is not None:
        path = tmp_path / "queued.toml"
        path.write_text(toml)
        flags["config"] = str(path)
    return load_config(flags, env={k: v for k, v in env.items() if k != CONFIG_ENV})


def check_env_names(env: Mapping[str, str]) -> None:
    known = {env_var(key) for key in SERVER_KEYS} | {CONFIG_ENV}
    unknown = {name for name in env if name.startswith("QUEUED_")} - known
    assert not unknown, f"not queued settings: {sorted(unknown)}"


def check_listeners(config: ServerConfig) -> None:
    assert config.host == "0.0.0.0"
    # Listening beyond loopback: a users file, or the server refuses to start.
    assert config.users_file is not None and not config.allow_anonymous
    check_exposure(config)
    assert {
        "memcache": config.memcache_port,
        "text": config.text_port,
        "rpc": config.rpc_port,
        "http": config.http_port,
    } == PORTS
    assert config.data_dir == Path(DATA_DIR)


# -- every file parses ---------------------------------------------------------------------------


def test_paths_are_routes_of_the_http_port() -> None:
    assert {"/metrics", "/stats.json", *PROBE_PATHS} <= set(ROUTES)


def test_deploy_has_the_expected_files() -> None:
    for path in (EXAMPLE, COMPOSE, PROMETHEUS, ALERTS, DASHBOARD):
        assert path.is_file(), path
    assert deploy_files(".yaml", ".yml", ".json", ".toml")


@pytest.mark.parametrize(
    "path",
    deploy_files(".yaml", ".yml", ".json", ".toml"),
    ids=lambda p: str(p.relative_to(DEPLOY)),
)
def test_every_deploy_file_parses(path: Path) -> None:
    docs = load_docs(path)
    assert docs, f"{path}: no document"
    assert all(isinstance(doc, dict) for doc in docs), f"{path}: a document is not a mapping"


# -- queued.example.toml -------------------------------------------------------------------------


def test_example_config_loads_as_exactly_the_defaults() -> None:
    config = load_config({"config": str(EXAMPLE)}, env={})
    assert config.config_file == EXAMPLE
    assert dataclasses.replace(config, config_file=None) == DEFAULTS


def test_example_config_writes_every_key() -> None:
    doc = load_one(EXAMPLE)
    assert set(doc) == {"server", "default"}, "the [queues.*] examples stay commented out"
    # Every key active, at its default, but the ones that default to unset; fsync once.
    assert set(doc["server"]) == set(SERVER_KEYS) - OPTIONAL_KEYS - {"fsync"}
    assert set(doc["default"]) == set(QUEUE_KEYS) - OPTIONAL_KEYS
    text = EXAMPLE.read_text()
    server, _, default = text.partition("\n[default]\n")
    mentioned = re.compile(r"^#?\s*([a-z_]+)\s*=", re.MULTILINE)
    assert set(SERVER_KEYS) - {"fsync"} <= set(mentioned.findall(server.split("\n[server]\n")[1]))
    assert set(QUEUE_KEYS) <= set(mentioned.findall(default))
    for key in OPTIONAL_KEYS:
        assert re.search(rf"^# {key} = ", text, re.MULTILINE), f"{key}: not shown commented out"


def test_example_config_commented_examples_are_valid(tmp_path: Path) -> None:
    """Uncommenting the optional keys and the [queues.*] examples gives a valid config."""
    line = re.compile(r'^# ?((?:\[queues\.(?:"[^"]+"|[\w-]+)\]|[a-z_]+ *=).*)$', re.MULTILINE)
    path = tmp_path / "uncommented.toml"
    path.write_text(line.sub(r"\1", EXAMPLE.read_text()))
    config = load_config({"config": str(path)}, env={})
    assert config.archive_dir is not None
    assert config.default.expire_to_queue and config.default.error_queue
    assert {"jobs", "jobs+audit"} <= set(config.queues)
    assert config.queue_config("jobs") != config.default
    assert config.queue_config("jobs+audit") != config.queue_config("jobs")


# -- compose.yaml --------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = load_one(COMPOSE)
    return doc


def mounts(service: Mapping[str, Any]) -> dict[str, str]:
    """target -> source of a compose service's short-syntax volumes."""
    out = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        out[target] = source
    return out


def test_compose_queued_service(tmp_path: Path) -> None:
    doc = compose()
    assert {"queued", "prometheus", "grafana"} <= set(doc["services"])
    queued = doc["services"]["queued"]
    assert (DEPLOY / queued["build"]).resolve() == ROOT  # the repository's Dockerfile
    published = {}
    for spec in queued["ports"]:
        address, host, container = str(spec).split(":")
        assert address == "127.0.0.1"  # a try-out stack: this machine only
        published[int(container)] = int(host)
    assert set(published) == set(PORTS.values())
    assert all(host == container for container, host in published.items())

    env = {k: str(v) for k, v in queued["environment"].items()}
    check_env_names(env)
    volumes = mounts(queued)
    assert volumes[DATA_DIR] in doc["volumes"], "the data directory is on a named volume"
    config_file = volumes[env[CONFIG_ENV]]
    config = effective_config((DEPLOY / config_file).read_text(), env, tmp_path)
    check_listeners(config)
    # SIGTERM: shutdown_grace for the sessions, then checkpoints and fsyncs.
    grace = int(str(queued["stop_grace_period"]).removesuffix("s"))
    assert grace * 1000 >= config.shutdown_grace + 10_000

    probe = " ".join(queued["healthcheck"]["test"])
    match = re.search(r"127\.0\.0\.1:(\d+)(/\w+)", probe)
    assert match is not None, probe
    assert int(match[1]) == config.http_port
    assert match[2] in PROBE_PATHS


def test_compose_bind_mounts_exist() -> None:
    for name, service in compose()["services"].items():
        for target, source in mounts(service).items():
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} -> {target}"


def test_compose_prometheus_and_grafana_wiring() -> None:
    services = compose()["services"]
    prom_mounts = mounts(services["prometheus"])
    prom_config = load_one(PROMETHEUS)
    assert (DEPLOY / prom_mounts["/etc/prometheus/prometheus.yml"]).resolve() == PROMETHEUS
    for rule_file in prom_config["rule_files"]:
        assert (DEPLOY / prom_mounts[rule_file]).resolve() == ALERTS
    assert any(arg == "--config.file=/etc/prometheus/prometheus.yml"
               for arg in services["prometheus"]["command"])

    grafana = mounts(services["grafana"])
    provisioning = {(DEPLOY / source).resolve(): target for target, source in grafana.items()}
    assert provisioning[GRAFANA_PROVISIONING] == "/etc/grafana/provisioning"
    (provider,) = load_one(GRAFANA_PROVISIONING / "dashboards" / "queued.yml")["providers"]
    dashboards_dir = Path(provider["options"]["path"])
    assert provisioning[DASHBOARD.parent] == str(dashboards_dir)
    (source,) = load_one(GRAFANA_PROVISIONING / "datasources" / "prometheus.yml")["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    assert "127.0.0.1:9090:9090" in services["prometheus"]["ports"]


# -- Prometheus ----------------------------------------------------------------------------------


def test_prometheus_scrapes_the_http_port() -> None:
    jobs = {job["job_name"]: job for job in load_one(PROMETHEUS)["scrape_configs"]}
    queued = jobs["queued"]
    assert queued["metrics_path"] == "/metrics"
    targets = [t for static in queued["static_configs"] for t in static["targets"]]
    assert targets == [f"queued:{DEFAULTS.http_port}"]
    assert targets[0].split(":")[0] in compose()["services"]


def test_compose_users_file_and_prometheus_credentials() -> None:
    services = compose()["services"]
    env = services["queued"]["environment"]
    users_path = mounts(services["queued"])[env["QUEUED_USERS_FILE"]]
    users = load_users(DEPLOY / users_path)
    assert users["admin"].admin and not users["prometheus"].put and not users["prometheus"].get
    assert users["prometheus"].metrics  # every queue's series, and nothing but /metrics
    auth = {job["job_name"]: job for job in load_one(PROMETHEUS)["scrape_configs"]}[
        "queued"]["basic_auth"]
    prom_mounts = {target: source for target, source in mounts(services["prometheus"]).items()}
    password = (DEPLOY / prom_mounts[auth["password_file"]]).read_text()
    assert users[auth["username"]].password.verify(password)  # the scrape can log in


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_one(ALERTS)["groups"] for rule in group["rules"]]


def test_alert_rules_are_complete() -> None:
    rules = alert_rules()
    names = {rule["alert"] for rule in rules}
    assert {
        "QueuedQueueGrowing",
        "QueuedOldestItemTooOld",
        "QueuedFsyncSlow",
        "QueuedNotReady",
        "QueuedJournalFailed",
        "QueuedDiskNearlyFull",
    } <= names
    for rule in rules:
        where = rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, where
        assert {"summary", "description"} <= set(rule["annotations"]), where
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), where
        queue_metrics = metrics_in(rule["expr"]) & (READER_METRICS | JOURNAL_METRICS)
        if queue_metrics and "sum" not in rule["expr"]:
            assert "{{ $labels.queue }}" in rule["annotations"]["summary"], where


def test_dashboard_and_alerts_use_only_contract_metrics() -> None:
    for path in (DASHBOARD, ALERTS):
        unknown = metrics_in(load_one(path)) - METRICS
        assert not unknown, f"{path.name}: not in the exporter's contract: {sorted(unknown)}"
    # A histogram is only series: name_bucket / _sum / _count.
    for path in (DASHBOARD, ALERTS):
        for text in strings(load_one(path)):
            for name in HISTOGRAMS:
                assert not re.search(rf"\b{name}\b(?!_)", text), f"{path.name}: bare {name}"


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus)"
)


def promtool(*args: str, cwd: Path) -> str:
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@needs_promtool
def test_promtool_checks_config_and_rules(tmp_path: Path) -> None:
    promtool("check", "rules", str(ALERTS), cwd=tmp_path)
    # The config names the rules by their path in the container: point it at the file here.
    config = load_one(PROMETHEUS)
    config["rule_files"] = [str(ALERTS)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    promtool("check", "config", "prometheus.yml", cwd=tmp_path)


@needs_promtool
def test_promtool_parses_the_dashboard_queries(tmp_path: Path) -> None:
    """Each panel's PromQL, with Grafana's variables filled in, as a recording rule."""
    exprs = [
        expr.replace("$__rate_interval", "1m").replace("$instance", ".*").replace("$queue", ".*")
        for expr in dashboard_exprs(load_one(DASHBOARD))
    ]
    rules = [{"record": f"dashboard:query_{i}", "expr": expr} for i, expr in enumerate(exprs)]
    (tmp_path / "dashboard.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]})
    )
    assert f"SUCCESS: {len(rules)} rules found" in promtool(
        "check", "rules", "dashboard.yml", cwd=tmp_path
    )


@needs_promtool
def test_promtool_alert_unit_tests() -> None:
    promtool("test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)


# -- Grafana -------------------------------------------------------------------------------------


def test_dashboard_shape() -> None:
    dashboard = load_one(DASHBOARD)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert "label_values(" in variables["queue"]["definition"]
    assert variables["queue"]["definition"].endswith(", queue)")
    (source,) = load_one(GRAFANA_PROVISIONING / "datasources" / "prometheus.yml")["datasources"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"])
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
    exprs = dashboard_exprs(dashboard)
    for expr in exprs:
        if metrics_in(expr) & (READER_METRICS | JOURNAL_METRICS):
            assert '$queue' in expr, f"not filtered by the queue variable: {expr}"
    used = metrics_in(dashboard)
    assert {
        "queued_queue_items",
        "queued_queue_bytes",
        "queued_queue_puts_total",
        "queued_queue_gets_total",
        "queued_queue_oldest_item_age_seconds",
        "queued_put_latency_seconds",
        "queued_get_latency_seconds",
        "queued_fsync_duration_seconds",
        "queued_journal_bytes",
        "queued_journal_segments",
        "queued_open_connections",
        "queued_commands_total",
        "queued_ready",
    } <= used
    quantiles = " ".join(e for e in exprs if "histogram_quantile" in e)
    for name in ("queued_put_latency_seconds", "queued_get_latency_seconds"):
        for q in ("0.5", "0.99"):
            assert re.search(rf"histogram_quantile\({q}, [^;]*{name}_bucket", quantiles), (q, name)
    assert "histogram_quantile(0.99" in quantiles and "queued_fsync_duration_seconds" in quantiles


# -- Kubernetes ----------------------------------------------------------------------------------


def k8s_objects() -> list[dict[str, Any]]:
    return [doc for path in deploy_files(".yaml", ".yml") if K8S in path.parents
            for doc in load_docs(path) if "kind" in doc and "apiVersion" in doc
            and doc["kind"] != "Kustomization"]


def k8s_one(kind: str) -> dict[str, Any]:
    (obj,) = [o for o in k8s_objects() if o["kind"] == kind]
    return obj


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load_one(K8S / "kustomization.yaml")
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests
    assert {"StatefulSet", "Service", "ConfigMap"} <= {o["kind"] for o in k8s_objects()}


def container() -> dict[str, Any]:
    (main,) = k8s_one("StatefulSet")["spec"]["template"]["spec"]["containers"]
    return dict(main)


def container_ports() -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container()["ports"]}


def port_number(port: int | str) -> int:
    return container_ports()[port] if isinstance(port, str) else port


def test_k8s_ports_and_services() -> None:
    assert container_ports() == PORTS
    pod_labels = k8s_one("StatefulSet")["spec"]["template"]["metadata"]["labels"]
    services = [o for o in k8s_objects() if o["kind"] == "Service"]
    assert any(s["spec"].get("clusterIP") == "None" for s in services)
    headless = k8s_one("StatefulSet")["spec"]["serviceName"]
    assert headless in {s["metadata"]["name"] for s in services if s["spec"].get("clusterIP")
                        == "None"}
    for service in services:
        assert service["spec"]["selector"].items() <= pod_labels.items()
        for port in service["spec"]["ports"]:
            assert port["port"] == PORTS[port["name"]]
            assert port_number(port["targetPort"]) == PORTS[port["name"]]


def test_k8s_probes() -> None:
    main = container()
    probes = {kind: main[kind] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    for kind, probe in probes.items():
        assert probe["httpGet"]["path"] in PROBE_PATHS, kind
        assert port_number(probe["httpGet"]["port"]) == DEFAULTS.http_port, kind
    assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert probes["livenessProbe"]["httpGet"]["path"] == "/livez"
    startup = probes["startupProbe"]
    # Recovery of a big journal can take minutes: allow at least ten.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_k8s_storage_config_and_environment(tmp_path: Path) -> None:
    statefulset = k8s_one("StatefulSet")
    pod = statefulset["spec"]["template"]["spec"]
    main = container()
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert mounts[claim["metadata"]["name"]] == DATA_DIR
    assert mounts[claim["metadata"]["name"]] in mounts_of_compose_queued()

    env = {e["name"]: e["value"] for e in main["env"]}
    check_env_names(env)
    config_path = Path(env[CONFIG_ENV])
    volumes = {v["name"]: v for v in pod["volumes"]}
    (volume_name,) = [n for n, path in mounts.items() if Path(path) == config_path.parent]
    config_map_name = volumes[volume_name]["configMap"]["name"]
    (config_map,) = [o for o in k8s_objects() if o["kind"] == "ConfigMap"
                     and o["metadata"]["name"] == config_map_name]
    config = effective_config(config_map["data"][config_path.name], env, tmp_path)
    check_listeners(config)
    # SIGTERM: shutdown_grace for the sessions, then checkpoints and fsyncs.
    assert pod["terminationGracePeriodSeconds"] * 1000 >= config.shutdown_grace + 10_000
    assert {"requests", "limits"} <= set(main["resources"])


def test_k8s_users_secret_is_mounted_and_fails_closed() -> None:
    kustomization = load_one(K8S / "kustomization.yaml")
    (generator,) = kustomization["secretGenerator"]
    (users_file,) = generator["files"]
    main = container()
    env = {e["name"]: e["value"] for e in main["env"]}
    users_path = Path(env["QUEUED_USERS_FILE"])
    pod = k8s_one("StatefulSet")["spec"]["template"]["spec"]
    secret_volumes = {v["name"] for v in pod["volumes"]
                      if v.get("secret", {}).get("secretName") == generator["name"]}
    mounted = {m["mountPath"] for m in main["volumeMounts"] if m["name"] in secret_volumes}
    assert mounted == {str(users_path.parent)} and users_path.name == users_file
    # The shipped placeholders are no passwords: the server refuses to start with them.
    with pytest.raises(UsersError, match="not a plaintext password"):
        load_users(K8S / users_file)
    with (K8S / users_file).open("rb") as f:
        assert tomllib.load(f)["users"]["prometheus"]["metrics"] is True  # scrapes it all


def mounts_of_compose_queued() -> set[str]:
    return set(mounts(compose()["services"]["queued"]))


def dockerfile_uid() -> int | None:
    """The numeric uid the image runs as, if the Dockerfile says so."""
    dockerfile = ROOT / "Dockerfile"
    if not dockerfile.exists():
        return None
    text = dockerfile.read_text()
    for pattern in (r"^USER\s+(\d+)", r"(?:--uid|-u)\s+(\d+)"):
        match = re.search(pattern, text, re.MULTILINE)
        if match:
            return int(match[1])
    return None


def test_k8s_security_context() -> None:
    pod = k8s_one("StatefulSet")["spec"]["template"]["spec"]
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] != 0
    assert "fsGroup" in security
    uid = dockerfile_uid()
    if uid is not None:
        assert security["runAsUser"] == uid, "runAsUser is not the Dockerfile's user"
    assert container()["securityContext"]["allowPrivilegeEscalation"] is False


def test_k8s_scrape_annotations() -> None:
    annotations = k8s_one("StatefulSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(DEFAULTS.http_port)
    assert annotations["prometheus.io/path"] == "/metrics"


# -- against a real server -----------------------------------------------------------------------


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=WAIT) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def exposed_series(text: str) -> dict[str, set[str]]:
    """metric -> label names, from the Prometheus text format."""
    series = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", re.MULTILINE)
    label = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="')
    out: dict[str, set[str]] = {}
    for name, labels in series.findall(text):
        out.setdefault(base_metric(name), set()).update(label.findall(labels))
    return out


async def test_real_server_exposes_what_dashboard_and_alerts_use(tmp_path: Path) -> None:
    async with running(make_config(tmp_path / "data")) as server:
        conn = await Conn.open(server.ports["memcache"])
        try:
            assert await conn.set("jobs", b"hello") == b"STORED"
            assert await conn.get("jobs") == b"hello"
        finally:
            await conn.aclose()
        port = server.ports["http"]
        health = {path: await trio.to_thread.run_sync(http_get, port, path)
                  for path in sorted(PROBE_PATHS)}
        status, body = await trio.to_thread.run_sync(http_get, port, "/metrics")
        stats_status, stats = await trio.to_thread.run_sync(http_get, port, "/stats.json")
    assert {path: code for path, (code, _) in health.items()} == dict.fromkeys(PROBE_PATHS, 200)
    assert stats_status == 200 and isinstance(json.loads(stats), dict)
    assert status == 200
    exposed = exposed_series(body)
    missing = used_metrics() - set(exposed)
    assert not missing, f"used by the dashboard / alerts but not exposed: {sorted(missing)}"
    for name, labels in METRIC_LABELS.items():
        if name in exposed:
            assert labels <= exposed[name], f"{name}: labels {sorted(exposed[name])}"


# -- a fleet (issue 20) --------------------------------------------------------------------------


def test_k8s_runs_a_fleet_clients_find_through_dns() -> None:
    statefulset = k8s_one("StatefulSet")
    spec = statefulset["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] >= 3 and spec["podManagementPolicy"] == "Parallel"
    # The headless Service is what clients resolve: its name in a dns:// address, and
    # the manifests say so.
    headless = spec["serviceName"]
    (service,) = [o for o in k8s_objects() if o["kind"] == "Service"
                  and o["metadata"]["name"] == headless]
    assert service["spec"]["clusterIP"] == "None"
    # Consumers must keep draining a pod whose /readyz fails (a full disk, a failed
    # journal): the name clients resolve gives not-ready pods too; the ClusterIP Service
    # (producers that do not care where a put lands) leaves them out.
    assert service["spec"]["publishNotReadyAddresses"] is True
    others = [o for o in k8s_objects() if o["kind"] == "Service"
              and o["metadata"]["name"] != headless]
    assert others and not any(o["spec"].get("publishNotReadyAddresses") for o in others)
    rpc = {p["name"]: p["port"] for p in service["spec"]["ports"]}["rpc"]
    address = f"dns://{headless}.<namespace>.svc.cluster.local:{rpc}"
    assert address in (K8S / "statefulset.yaml").read_text()
    assert address in (K8S / "service.yaml").read_text()
    # One pod per node where possible.
    pod = spec["template"]["spec"]
    (term,) = pod["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= pod_labels.items()
    # Drains take one server at a time.
    pdb = k8s_one("PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] == 1
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    # preStop lets the pod leave the ClusterIP Service before SIGTERM (not the headless
    # one's answer, which keeps terminating pods: the comment must not promise that);
    # the grace period covers it, shutdown_grace for the sessions' batch, and
    # checkpoints and fsyncs.
    text = " ".join(line.strip().lstrip("#").strip()
                    for line in (K8S / "statefulset.yaml").read_text().splitlines())
    assert "preStop hook waits 5 s while the pod leaves the ClusterIP Service" in text
    assert "headless Service gain nothing from the wait" in text
    command = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "/opt/queued/bin/python"  # the image's Python (no shell sleep)
    match = re.fullmatch(r"import time; time\.sleep\((\d+)\)", command[-1])
    assert match is not None, command
    assert (pod["terminationGracePeriodSeconds"] * 1000
            >= int(match[1]) * 1000 + DEFAULTS.shutdown_grace + 10_000)


def test_k8s_replicated_storage_class_example() -> None:
    path = K8S / "storage" / "longhorn.yaml"
    (storage_class,) = load_docs(path)
    assert storage_class["kind"] == "StorageClass"
    assert storage_class["provisioner"] == "driver.longhorn.io"
    assert storage_class["parameters"]["numberOfReplicas"] == "3"
    assert storage_class["reclaimPolicy"] == "Retain"
    text = path.read_text()
    assert "fsync waits" in text  # its cost is said where it is chosen
    name = storage_class["metadata"]["name"]
    assert f"storageClassName: {name}" in (K8S / "statefulset.yaml").read_text()
    # Cluster-wide and needing Longhorn: applied on its own, not by the kustomization.
    assert "storage/longhorn.yaml" not in load_one(K8S / "kustomization.yaml")["resources"]


def test_compose_fleet_profile() -> None:
    services = compose()["services"]
    queued = services["queued"]
    fleet = {name: s for name, s in services.items() if name.startswith("queued")}
    assert len(fleet) == 3
    assert all(s.get("profiles") == ["fleet"] for n, s in fleet.items() if n != "queued")
    assert "profiles" not in queued  # `docker compose up` alone still starts one server
    data = {mounts(s)[DATA_DIR] for s in fleet.values()}
    assert len(data) == 3 and data <= set(compose()["volumes"])  # a journal volume each
    published = [str(p).split(":")[1] for s in fleet.values() for p in s["ports"]]
    assert len(published) == len(set(published))
    for name, server in fleet.items():
        assert server["image"] == queued["image"], name
        assert server["environment"] == queued["environment"], name
        assert server["networks"]["default"]["aliases"] == ["queued-fleet"], name
        assert mounts(server).keys() == mounts(queued).keys(), name
    assert "dns://queued-fleet:2229" in COMPOSE.read_text()
