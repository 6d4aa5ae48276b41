"""The `queued` command line: the server (`serve`, `passwd`), journal tools (`dump`, `check`)
and a client (`put`, `get`, ...), one module each: serve, journal_tools, client_commands
(with client_options, what every client command shares, and stdout, the pipe `get` writes to).

Owns the parser and the dispatch to those modules; every decision about bytes is made by
the journal format and recovery, and every call to a server goes through queued.client.
`dump` and `check` never modify the files they read.
"""

from __future__ import annotations

import argparse
import difflib
import io
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from queued import __version__, build
from queued.cli.client_commands import CLIENT_COMMANDS, add_client_commands, client_command
from queued.cli.client_options import CLIENT_EPILOG, EXIT_OK
from queued.cli.journal_tools import (
    CHECK_MAX_LOOKS,
    CHECK_PAUSE,
    CHECK_STABLE_LOOKS,
    EXIT_CANNOT_CHECK,
    check,
    describe,
    dump,
)
from queued.cli.serve import passwd_command, serve_command
from queued.config import add_serve_arguments

__all__ = ["CHECK_MAX_LOOKS", "CHECK_PAUSE", "CHECK_STABLE_LOOKS", "build_parser", "check",
           "describe", "dump", "main", "parse_args", "run"]


class VersionAction(argparse.Action):
    """`--version`: the version and which build the server would run (the server's modules
    imported first, so a compiled build shows)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        import queued.server.reactor  # noqa: F401

        print(f"queued {__version__} ({build()})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="queued", description="queued: a durable queue server",
        epilog=CLIENT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=VersionAction, nargs=0,
                        help="show the version and the build (pure Python or compiled) and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    p_dump = sub.add_parser("dump", help="print every record of a journal file")
    p_dump.add_argument("file", type=Path)
    p_check = sub.add_parser(
        "check", help="verify every journal file of a data directory",
        description="Verify every journal file of a data directory, without changing any, "
                    "and say what recovery would do. Safe next to a running server: a batch "
                    "still being written is reported as `busy`, not as damage.",
        epilog="exit codes: 0 healthy; 1 damage found; 2 usage error, or the directory "
               "cannot be checked (missing, unreadable).")
    p_check.add_argument("dir", type=Path)
    p_serve = sub.add_parser("serve", help="run the server in the foreground")
    add_serve_arguments(p_serve)
    sub.add_parser(
        "passwd", help="print a password hash for the users file",
        description="Read a password (one line of stdin, or asked twice at a terminal) and "
                    "print its salted scrypt hash: the `password` of a [users.NAME] table "
                    "in the users file (see docs/security.md).")
    add_client_commands(sub)
    for name in ("dump", "check", "serve", *CLIENT_COMMANDS):  # for parse_args's errors
        command_parser = sub.choices[name]
        command_parser.set_defaults(command_parser=command_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    try:
        code = run(args)
        sys.stdout.flush()  # here, so that a reader that went away is seen below
    except BrokenPipeError:
        # The reader of our stdout went away (`queued peek q | head -3`): as for any Unix
        # filter, that is the reader's choice, not an error. Silence the interpreter's
        # flush at exit. (`get` confirms only what the reader took: see get_command.)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if args.command == "check":  # its verdict must not depend on who reads the report
            return check(args.dir, io.StringIO())
        return EXIT_OK
    return code


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; its exit code."""
    if args.command in CLIENT_COMMANDS:
        return client_command(args)
    try:
        if args.command == "dump":
            return dump(args.file, sys.stdout)
        if args.command == "serve":
            return serve_command(args)
        if args.command == "passwd":
            return passwd_command()
        if args.command == "check":
            if not args.dir.is_dir():
                print(f"queued check: {args.dir} is not a directory", file=sys.stderr)
                return EXIT_CANNOT_CHECK
            return check(args.dir, sys.stdout)
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):
            raise
        print(f"queued {args.command}: {exc}", file=sys.stderr)
        return 2
    return 2


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args, except that an argument the subcommand does not know is reported by
    the subcommand's parser (its usage, not the top-level one), with a close match."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        before = argv[:argv.index(args.command)] if args.command in argv else []
        owner: argparse.ArgumentParser = (
            parser if set(unknown) & set(before) else args.command_parser)
        known = re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", owner.format_usage())
        hints = [f"{u} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(
                    u.partition("=")[0], known, n=1, cutoff=0.8)) else u for u in unknown]
        owner.error(f"unrecognized arguments: {' '.join(hints)}")
    return args
