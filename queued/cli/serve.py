"""`queued serve` (the server in the foreground) and `queued passwd` (a users file's hash).

Owns turning the server's start-up and stop into log lines and exit codes; what the
server does is queued.server.app's, what it does to its process queued.server.tuning's.
"""

from __future__ import annotations

import argparse
import getpass
import logging
import os
import sys
from functools import partial

import trio

from queued import __version__, build
from queued import config as qconfig
from queued.cli.logs import setup_logging
from queued.config import ConfigError, load_config
from queued.config.users import hash_password
from queued.errors import NotSavedError, QueuedError
from queued.server.app import serve
from queued.server.tuning import freeze_startup_heap, tune_process


def passwd_command() -> int:
    """`queued passwd`: a password from stdin (or the terminal) -> its hash on stdout."""
    if sys.stdin.isatty():
        password = getpass.getpass("password: ")
        if getpass.getpass("again: ") != password:
            print("queued passwd: the two passwords differ", file=sys.stderr)
            return 2
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        print("queued passwd: empty password", file=sys.stderr)
        return 2
    try:
        print(hash_password(password))
    except ValueError as exc:
        print(f"queued passwd: {exc}", file=sys.stderr)
        return 2
    return 0


def serve_command(args: argparse.Namespace) -> int:
    """`queued serve`: load the config, log, run until SIGTERM/SIGINT/shutdown."""
    try:
        config = load_config(args)
    except ConfigError as exc:
        print(f"queued serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_format, sys.stderr)
    log = logging.getLogger("queued")
    log.info("queued %s (%s) starting (pid %d) with this config:\n%s", __version__, build(),
             os.getpid(), qconfig.describe(config),
             extra={"event": "starting", "version": __version__, "build": build()})
    tune_process()
    try:
        trio.run(_serve_tuned, config)
    except Exception as exc:
        root = _single(exc)  # trio nurseries wrap errors in exception groups
        if isinstance(root, ConfigError):
            log.error("%s", root)
            return 2
        if isinstance(root, NotSavedError):
            log.error("stopped, but could not save everything:\n%s",
                      "\n".join(f"  - {u}" for u in root.unsaved),
                      extra={"event": "stopped_unsaved", "unsaved": root.unsaved})
            return 1
        if isinstance(root, QueuedError):
            log.error("cannot start: %s", root)
            return 1
        raise
    return 0



async def _serve_tuned(config: qconfig.ServerConfig) -> None:
    """`serve`, with the start-up heap frozen once the server serves (see
    `freeze_startup_heap`)."""
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve, config, handle_signals=True))
        frozen = freeze_startup_heap()
        logging.getLogger("queued").info(
            "start-up heap: %d objects left out of garbage collections", frozen,
            extra={"event": "heap_frozen", "objects": frozen})


def _single(exc: BaseException) -> BaseException:
    """The one exception inside nested single-member exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc

