"""The servers of the browser tests: `queued serve` subprocesses fed by the real client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from security_util import users_toml
from server_util import HOST, ServerProcess

from queued.client import Client

USERS = dict(
    viewer={"password": "viewer pw", "get": ["*"]},
    root={"password": "root pw", "admin": True, "put": ["*"], "get": ["*"]},
)


class Served:
    """A running server: its HTTP base URL and a client (logged in as root when users)."""

    def __init__(self, proc: ServerProcess, login: dict[str, str]) -> None:
        self.proc = proc
        self.url = f"http://{HOST}:{proc.http}"
        self.client = Client(f"{HOST}:{proc.rpc}", connect_timeout=5.0, read_timeout=10.0,
                             **login)

    def close(self) -> None:
        self.client.close()


def serve(tmp_path: Path, users: bool, toml: str = "") -> Iterator[Served]:
    """A server (with USERS when `users`), `toml` added to its config file."""
    config = None
    login: dict[str, str] = {}
    if users:
        (tmp_path / "users.toml").write_text(users_toml(**USERS))
        toml = f'[server]\nusers_file = "{tmp_path / "users.toml"}"\n' + toml
        login = {"user": "root", "password": USERS["root"]["password"]}
    if toml:
        config = tmp_path / "queued.toml"
        config.write_text(toml)
    proc = ServerProcess(tmp_path / "data", tmp_path / "server.log", config)
    proc.start()
    served = Served(proc, login)
    try:
        yield served
    finally:
        served.close()
        proc.kill()


