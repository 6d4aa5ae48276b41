"""Helpers for the config tests: config files in a temp dir, loaded with an explicit
environment (never os.environ), and the `serve` flags parsed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from queued.config import ConfigError, ServerConfig, add_serve_arguments, load_config

NO_ENV: dict[str, str] = {}


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_file(path: Path, env: dict[str, str] | None = None) -> ServerConfig:
    return load_config({"config": str(path)}, env=NO_ENV if env is None else env)


def error_of(path_or_text: str, tmp_path: Path) -> str:
    path = write(tmp_path, path_or_text)
    with pytest.raises(ConfigError) as info:
        load_file(path)
    return str(info.value)


def parse_flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


INHERIT = """
[default]
max_items = 100
max_age = "1m"
fsync = "never"

[queues.jobs]
max_items = 1000
fsync = "20ms"
journal_size = "1MiB"

[queues."jobs+audit"]
max_age = "1h"
error_queue = "audit_errors"

[queues."other+r1"]
max_items = 1
"""
