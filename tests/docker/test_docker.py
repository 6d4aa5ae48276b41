"""The Docker image end to end: build, run, put/get with the real client, scrape /metrics,
health, `docker stop`, and a new container on the same volume finding the unconsumed items.

Run by `make test-docker` (`pytest -m docker tests/docker`); plain `make test` deselects the
`docker` marker. tests/docker/setup.sh first makes sure a dockerd answers (installing and
starting one if needed) and that the base image exists; the test skips only when setup.sh
says this machine cannot run dockerd at all (exit status 77).

The containers use the host's network (dockerd runs with --bridge=none here) on free ports
picked by the test, and are removed by name, with their volume, however the test ends.

Environment: QUEUED_DOCKER_IMAGE (tag to build, default queued:test),
QUEUED_DOCKER_BASE_IMAGE (BASE_IMAGE build argument, default queued-base:bookworm, which
setup.sh makes), QUEUED_DOCKER_CONTEXT (build context, default the repository).
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pymemcache.client.base import Client as MemcacheClient

from queued import __version__
from queued.client import Client, ClientError

pytestmark = pytest.mark.docker

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SETUP = HERE / "setup.sh"
#: The compose stack's users file and its demo credentials (see the file).
USERS_FILE = REPO / "deploy" / "users.example.toml"
LOGIN = {"user": "app", "password": "app-change-me"}
SCRAPER = ("prometheus", (REPO / "deploy" / "prometheus" / "queued.password").read_text())
IMAGE = os.environ.get("QUEUED_DOCKER_IMAGE") or "queued:test"
BASE_IMAGE = os.environ.get("QUEUED_DOCKER_BASE_IMAGE") or "queued-base:bookworm"
CONTEXT = Path(os.environ.get("QUEUED_DOCKER_CONTEXT") or REPO)
CANNOT_RUN_DOCKERD = 77  # setup.sh's exit status when this machine cannot run dockerd
#: Label of every container and volume the test makes: the PID of the pytest that made it.
OWNER = "queued-test.owner"

#: Docker stop's default: SIGTERM, then SIGKILL after this many seconds.
STOP_TIMEOUT = 10.0
QUEUE = "docker_jobs"
MC_QUEUE = "docker_mc"
ITEMS = 50
TAKEN = 20  # taken before the stop; the rest must survive it


def log(message: str) -> None:
    print(f"[docker test] {message}", flush=True)


def docker(*args: str, timeout: float = 60, check: bool = True,
           ) -> subprocess.CompletedProcess[str]:
    """`docker ARGS`, bounded; on failure (with check) an AssertionError with its output."""
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def image() -> str:
    """A dockerd and the image built from the repository (the Dockerfile's BASE_IMAGE given)."""
    started = time.monotonic()
    setup = subprocess.run([str(SETUP)], capture_output=True, text=True, timeout=1800,
                           stdin=subprocess.DEVNULL, check=False)
    print(setup.stderr, end="")
    if setup.returncode == CANNOT_RUN_DOCKERD:
        lines = setup.stderr.strip().splitlines() or ["(no message)"]
        pytest.skip(f"this machine cannot run dockerd: {lines[-1]}")
    assert setup.returncode == 0, f"tests/docker/setup.sh exited {setup.returncode}"
    log(f"setup.sh: {time.monotonic() - started:.1f} s")
    remove_leftovers()

    started = time.monotonic()
    build_started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1))
    # --network=host: dockerd runs without a bridge here, and pip needs the network.
    docker("build", "--network=host", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
           "--tag", IMAGE, str(CONTEXT), timeout=1200)
    size = int(docker("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    # Earlier builds' untagged images go, so that repeated runs do not fill the disk: the
    # images a rebuild untagged, and the classic builder's build-stage results but the newest
    # (this build's, the cache of the next).
    docker("image", "prune", "--force", "--filter", "label=org.opencontainers.image.title=queued",
           "--filter", f"until={build_started}", check=False)
    stages = docker("images", "--quiet", "--filter", "dangling=true", "--filter",
                    "label=org.opencontainers.image.title=queued-build").stdout.split()
    if len(stages) > 1:  # newest first
        docker("rmi", *stages[1:], check=False)
    log(f"docker build {IMAGE} (BASE_IMAGE={BASE_IMAGE}): {time.monotonic() - started:.1f} s, "
        f"{size / 1e6:.0f} MB")
    return IMAGE


def remove_leftovers() -> None:
    """Containers and volumes of earlier runs whose pytest is gone: killed, or interrupted
    while dockerd was still creating a container that its cleanup had already missed."""
    def stale(field: str, *listing: str) -> list[str]:
        found = []
        for line in docker(*listing, "--filter", f"label={OWNER}", "--format",
                           f'{{{{{field}}}}} {{{{.Label "{OWNER}"}}}}').stdout.splitlines():
            ident, _, owner = line.partition(" ")
            try:
                os.kill(int(owner), 0)
            except (ValueError, ProcessLookupError):
                found.append(ident)
            except PermissionError:
                pass  # alive, another user's
        return found

    containers = stale(".ID", "ps", "--all")
    if containers:
        docker("rm", "--force", "--volumes", *containers, check=False)
    volumes = stale(".Name", "volume", "ls")
    if volumes:
        docker("volume", "rm", "--force", *volumes, check=False)
    if containers or volumes:
        log(f"removed leftovers of earlier runs: {' '.join(containers + volumes)}")


class Ports:
    """Free TCP ports for one container's four listeners (it binds the host's network)."""

    def __init__(self) -> None:
        socks = [socket.socket() for _ in range(4)]
        try:
            for s in socks:
                s.bind(("0.0.0.0", 0))
            self.memcache, self.text, self.rpc, self.http = (
                s.getsockname()[1] for s in socks)
        finally:
            for s in socks:
                s.close()

    def env(self) -> list[str]:
        return ["-e", f"QUEUED_MEMCACHE_PORT={self.memcache}",
                "-e", f"QUEUED_TEXT_PORT={self.text}",
                "-e", f"QUEUED_RPC_PORT={self.rpc}",
                "-e", f"QUEUED_HTTP_PORT={self.http}"]

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http}{path}"


class Docker:
    """Containers and volumes of one test, removed (by name) when it ends."""

    def __init__(self, image: str) -> None:
        self.image = image
        self.prefix = f"queued-test-{uuid.uuid4().hex[:10]}"
        self.containers: list[str] = []
        self.volumes: list[str] = []

    def volume(self) -> str:
        name = f"{self.prefix}-data"
        self.volumes.append(name)
        docker("volume", "create", "--label", f"{OWNER}={os.getpid()}", name)
        return name

    def run(self, volume: str, ports: Ports, *, users: bool = True) -> str:
        """A container on `volume`; with `users`, deploy/users.example.toml is its users
        file (the image listens on 0.0.0.0: without one it refuses to start)."""
        name = f"{self.prefix}-{len(self.containers) + 1}"
        self.containers.append(name)
        login = ["--volume", f"{USERS_FILE}:/etc/queued/users.toml:ro",
                 "-e", "QUEUED_USERS_FILE=/etc/queued/users.toml"] if users else []
        docker("run", "--detach", "--name", name, "--label", f"{OWNER}={os.getpid()}",
               "--network=host",
               "--volume", f"{volume}:/var/lib/queued",
               # Checked every second rather than every 10 s, so the test need not wait.
               "--health-interval=1s", "--health-timeout=3s", "--health-start-period=30s",
               *login, *ports.env(), self.image)
        log(f"started {name}")
        return name

    def state(self, name: str) -> dict[str, object]:
        state: dict[str, object] = json.loads(
            docker("inspect", "--format", "{{json .State}}", name).stdout)
        return state

    def logs(self, name: str) -> str:
        proc = docker("logs", name, check=False)
        return proc.stdout + proc.stderr

    def wait_ready(self, name: str, ports: Ports, timeout: float = 60) -> None:
        """Until /readyz answers 200 (recovery done, listeners up); fail if the container dies."""
        deadline = time.monotonic() + timeout
        while True:
            status, _ = http_get(ports.url("/readyz"))
            if status == 200:
                return
            state = self.state(name)
            if not state["Running"]:
                raise AssertionError(f"{name} is not running: {state}\n{self.logs(name)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}: /readyz not 200 after {timeout} s (last {status})")
            time.sleep(0.2)

    def cleanup(self) -> None:
        for name in self.containers:
            docker("rm", "--force", "--volumes", name, check=False)
        for volume in self.volumes:
            docker("volume", "rm", "--force", volume, check=False)


@pytest.fixture
def dock(image: str) -> Iterator[Docker]:
    d = Docker(image)
    try:
        yield d
    finally:
        d.cleanup()


# -- helpers -----------------------------------------------------------------------------------


def http_get(url: str, *, auth: tuple[str, str] | None = None) -> tuple[int, str]:
    """(status, body) of a GET (with HTTP Basic `auth`); (0, error) when nothing answered.
    No proxy for 127.0.0.1."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url)
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with opener.open(request, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def scrape(ports: Ports) -> dict[str, list[tuple[dict[str, str], float]]]:
    """/metrics as {sample name: [(labels, value)]}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _ = http_get(ports.url("/metrics"))
    assert status == 401  # the scrape logs in (deploy/prometheus does the same)
    status, body = http_get(ports.url("/metrics"), auth=SCRAPER)
    assert status == 200, body
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), s.value))
    return samples


def queue_items(samples: dict[str, list[tuple[dict[str, str], float]]], queue: str) -> float:
    found = [v for labels, v in samples.get("queued_queue_items", [])
             if labels == {"queue": queue, "reader": ""}]
    assert len(found) == 1, samples.get("queued_queue_items")
    return found[0]


def wait_healthy(dock: Docker, name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        health = dock.state(name).get("Health") or {}
        assert isinstance(health, dict)
        if health.get("Status") == "healthy":
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} not healthy after {timeout} s: {health}")
        time.sleep(0.5)


def drain(client: Client, queue: str) -> list[bytes]:
    """Every item left in `queue`, in order (plain gets, until one waits 500 ms for nothing)."""
    got: list[bytes] = []
    while items := client.get(queue, max_items=1000, timeout_ms=500):
        got.extend(i.data for i in items)
    return got


def stop(dock: Docker, name: str) -> float:
    """`docker stop` (SIGTERM, SIGKILL after 10 s); its duration, having checked a clean exit."""
    started = time.monotonic()
    docker("stop", "--time", str(int(STOP_TIMEOUT)), name, timeout=STOP_TIMEOUT + 30)
    took = time.monotonic() - started
    state = dock.state(name)
    logs = dock.logs(name)
    assert took < STOP_TIMEOUT, f"docker stop took {took:.1f} s\n{logs}"
    assert state["ExitCode"] == 0, f"exit code {state['ExitCode']}\n{logs}"
    assert not state["OOMKilled"]
    assert "shutting down: SIGTERM" in logs, logs
    assert "stopped cleanly" in logs, logs
    return took


# -- the test ----------------------------------------------------------------------------------


def test_container_serves_stops_cleanly_and_keeps_its_volume(dock: Docker) -> None:
    volume = dock.volume()
    items = [f"item-{i:03d}".encode() for i in range(ITEMS)]
    first = ""
    second = ""
    try:
        # -- first container: put, take some, scrape, stop -----------------------------------
        ports = Ports()
        first = dock.run(volume, ports)
        started = time.monotonic()
        dock.wait_ready(first, ports)
        log(f"{first} ready in {time.monotonic() - started:.1f} s")

        config = json.loads(docker("inspect", "--format", "{{json .Config}}", first).stdout)
        assert config["User"] == "10001:10001"
        assert set(config["ExposedPorts"]) == {f"{p}/tcp" for p in (22133, 2222, 2229, 2223)}
        assert set(config["Volumes"]) == {"/var/lib/queued"}
        assert config["StopSignal"] == "SIGTERM"
        assert config["Entrypoint"] == ["/opt/queued/bin/queued", "serve"]
        assert docker("exec", first, "id", "-u").stdout.strip() == "10001"
        # The server is PID 1 (exec form), so docker stop's SIGTERM reaches it.
        cmdline = docker("exec", first, "cat", "/proc/1/cmdline").stdout.split("\0")
        assert cmdline[1:3] == ["/opt/queued/bin/queued", "serve"], cmdline

        with Client([f"127.0.0.1:{ports.rpc}"], **LOGIN) as client:
            assert client.put(QUEUE, items) == ITEMS
            taken = client.get(QUEUE, max_items=TAKEN, timeout_ms=1000)
            assert [i.data for i in taken] == items[:TAKEN]
        mc = MemcacheClient(("127.0.0.1", ports.memcache), default_noreply=False,
                            connect_timeout=5, timeout=5)
        try:
            assert mc.set("login", f"{LOGIN['user']} {LOGIN['password']}")
            assert mc.set(MC_QUEUE, b"via-memcache")
        finally:
            mc.close()

        status, body = http_get(ports.url("/livez"))
        assert status == 200, body
        status, body = http_get(ports.url("/readyz"))
        assert status == 200, body
        samples = scrape(ports)
        (build_labels, build_value), = samples["queued_build_info"]
        assert build_value == 1
        assert build_labels["version"] == __version__
        assert re.fullmatch(r"3\.\d+\.\d+", build_labels["python"]), build_labels
        # The image serves the mypyc-compiled build (the Dockerfile's QUEUED_BUILD default).
        assert build_labels["build"] == "mypyc", build_labels
        assert re.search(r"\(compiled with mypyc: \d+ modules, /opt/queued/lib/python3\.\d+/"
                         r"site-packages\) starting", dock.logs(first)), dock.logs(first)
        assert samples["queued_ready"] == [({}, 1.0)]
        assert queue_items(samples, QUEUE) == ITEMS - TAKEN
        assert queue_items(samples, MC_QUEUE) == 1

        started = time.monotonic()
        wait_healthy(dock, first)
        log(f"{first} healthy after {time.monotonic() - started:.1f} s more")

        # Stop with a client connected and a get waiting: the get is answered (empty) or
        # its connection closes, and neither holds up the shutdown.
        waiting: list[object] = []
        with Client([f"127.0.0.1:{ports.rpc}"], backoff=0.2, max_backoff=0.2,
                    **LOGIN) as other:
            def wait_for_item() -> None:
                try:
                    waiting.append(other.get("docker_nothing", timeout_ms=30_000))
                except ClientError as exc:
                    waiting.append(exc)

            waiter = threading.Thread(target=wait_for_item, daemon=True)
            waiter.start()
            time.sleep(0.5)
            took = stop(dock, first)
            waiter.join(15)
            assert not waiter.is_alive()
        log(f"docker stop {first}: {took:.2f} s, exit 0, a waiting get ended with {waiting}")
        assert waiting and (waiting[0] == [] or isinstance(waiting[0], ClientError)), waiting

        # -- second container, same volume: exactly the unconsumed items, in order --------
        ports = Ports()
        second = dock.run(volume, ports)
        dock.wait_ready(second, ports)
        logs = dock.logs(second)
        left = ITEMS - TAKEN + 1  # and the memcache one
        assert re.search(rf"recovered \d+ queues: {left} items waiting", logs), logs
        assert queue_items(scrape(ports), QUEUE) == ITEMS - TAKEN
        with Client([f"127.0.0.1:{ports.rpc}"], **LOGIN) as client:
            assert drain(client, QUEUE) == items[TAKEN:]
            assert client.get(QUEUE, timeout_ms=200) == []
        mc = MemcacheClient(("127.0.0.1", ports.memcache), default_noreply=False,
                            connect_timeout=5, timeout=5)
        try:
            assert mc.set("login", f"{LOGIN['user']} {LOGIN['password']}")
            assert mc.get(MC_QUEUE) == b"via-memcache"
        finally:
            mc.close()
        assert queue_items(scrape(ports), QUEUE) == 0
        took = stop(dock, second)
        log(f"docker stop {second}: {took:.2f} s, exit 0")
    except BaseException:
        for name in (first, second):
            if name:
                print(f"---- docker logs {name} ----\n{dock.logs(name)}")
        raise


def test_container_without_users_refuses_to_listen_on_every_interface(dock: Docker) -> None:
    """The image binds 0.0.0.0: with no users file (and no QUEUED_ALLOW_ANONYMOUS) the
    server exits at once, naming the two ways on, before opening any port."""
    ports = Ports()
    name = dock.run(dock.volume(), ports, users=False)
    deadline = time.monotonic() + 60
    while dock.state(name)["Running"]:
        assert time.monotonic() < deadline, dock.logs(name)
        time.sleep(0.2)
    logs = dock.logs(name)
    assert dock.state(name)["ExitCode"] == 2, logs
    assert "QUEUED_USERS_FILE" in logs and "QUEUED_ALLOW_ANONYMOUS=1" in logs, logs
    assert "listening for" not in logs, logs
