"""The `queued` command line: the server (`serve`), journal tools (`dump`, `check`) and a client.

Owns argument parsing and human-readable output only; every decision about
bytes is made by journal_format / recovery, and every call goes through
queued.client. `dump` and `check` never modify the files they read.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import difflib
import functools
import gc
import getpass
import io
import json
import logging
import os
import re
import ssl
import sys
import textwrap
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, TextIO, TypeVar

import trio

from queued import __version__
from queued import config as qconfig
from queued.cli_stdout import Stdout
from queued.client import (
    DEFAULT_PORT,
    AmbiguousPut,
    AuthFailed,
    Client,
    ClientError,
    ConnectionFailed,
    Item,
    Timeout,
    Unauthenticated,
    parse_servers,
)
from queued.client.credentials import tls_files_context
from queued.config import ConfigError, add_serve_arguments, load_config
from queued.config.users import hash_password
from queued.errors import CorruptRecordError, NotSavedError, QueuedError
from queued.journal import format as jf
from queued.logs import setup_logging
from queued.server.app import serve
from queued.storage.files import read_checkpoint, read_dedup, read_producers
from queued.storage.recovery import Inspection, TailState, inspect_segment

PREVIEW = 40


def _ms(ms: int) -> str:
    try:
        return _dt.datetime.fromtimestamp(ms / 1000, _dt.UTC).isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):
        return f"{ms}ms"


def _preview(data: bytes) -> str:
    text = repr(data[:PREVIEW])
    return text + ("..." if len(data) > PREVIEW else "")


def describe(rec: jf.Record) -> str:
    """One human-readable line for one record."""
    if isinstance(rec, jf.Put):
        exp = f" expires={_ms(rec.expire_time_ms)}" if rec.expire_time_ms is not None else ""
        flags = f" flags={rec.flags}" if rec.flags else ""  # a FLAGS record led the PUT
        if isinstance(rec, jf.DelayedPut):  # a DELAY record led the PUT
            flags += f" due={_ms(rec.due_ms)}"
        return (
            f"PUT id={rec.id} size={len(rec.data)} errors={rec.error_count} "
            f"added={_ms(rec.add_time_ms)}{exp}{flags} data={_preview(rec.data)}"
        )
    if isinstance(rec, jf.ReadHead):
        return f"READ_HEAD id={rec.id}"
    if isinstance(rec, jf.ReadDone):
        shown = ",".join(str(i) for i in rec.ids[:20])
        more = f",... ({len(rec.ids)} ids)" if len(rec.ids) > 20 else ""
        return f"READ_DONE ids=[{shown}{more}]"
    if isinstance(rec, jf.Check):
        return f"CHECK covers={rec.length} crc32={rec.crc:08x}"
    if isinstance(rec, jf.Compacted):
        return f"COMPACTED replaces segments {rec.first_number}..{rec.last_number}"
    if isinstance(rec, jf.ReadErrors):
        shown = ",".join(f"{i}:{n}" for i, n in rec.entries[:20])
        more = f",... ({len(rec.entries)} ids)" if len(rec.entries) > 20 else ""
        return f"READ_ERRORS id:count=[{shown}{more}]"
    if isinstance(rec, jf.ReadDelays):
        shown = ",".join(f"{i}:{_ms(d)}" for i, d in rec.entries[:20])
        more = f",... ({len(rec.entries)} ids)" if len(rec.entries) > 20 else ""
        return f"READ_DELAYS id:due=[{shown}{more}]"
    if isinstance(rec, jf.Incarnation):
        return f"INCARNATION {rec.incarnation}"
    if isinstance(rec, jf.ProducerMark):
        return (f"PRODUCER id={_preview(rec.producer)} sequence={rec.sequence} "
                f"first_id={rec.first_id} count={rec.count} at={_ms(rec.time_ms)}")
    if isinstance(rec, jf.DedupMark):
        return (f"DEDUP key={_preview(rec.key)} first_id={rec.first_id} count={rec.count} "
                f"at={_ms(rec.time_ms)}")
    kind = f" kind={rec.kind}" if rec.kind else ""  # an extension record of a later release
    return (f"UNKNOWN command={rec.command}{kind} header_words={rec.header_words} "
            f"data={rec.data_size}")


def dump(path: Path, out: TextIO) -> int:
    """Print every record of a journal file; 0 when it ends cleanly, 1 otherwise."""
    dec = jf.RecordDecoder(kind=None)
    with path.open("rb") as f:
        while True:
            try:
                ev = dec.next_event()
            except CorruptRecordError as exc:
                print(f"{exc.offset:>10}  CORRUPT: {exc.reason}", file=out)
                return 1
            if ev is jf.NEED_DATA:
                dec.receive_data(f.read(1 << 20))
                continue
            if isinstance(ev, jf.Decoded):
                print(f"{ev.offset:>10}  {describe(ev.record)}", file=out)
                continue
            if isinstance(ev, jf.TornTail):
                print(f"{ev.offset:>10}  TORN: {ev.available} bytes of an unfinished record",
                      file=out)
                return 1
            assert isinstance(ev, jf.EndOfData)
            kind = dec.detected_kind.value if dec.detected_kind else "?"
            sealed = "with check records" if dec.sealed else "without check records (seed)"
            end = "a zero byte" if ev.zero_byte else "end of file"
            print(f"{ev.offset:>10}  END ({kind} file {sealed}; valid data ends at {end})",
                  file=out)
            return 0


#: `check` looks again at a segment whose tail is unfinished: a running server's batch is
#: written in milliseconds, so a tail that stays the same for CHECK_STABLE_LOOKS looks
#: CHECK_PAUSE seconds apart is damage, and one still changing after CHECK_MAX_LOOKS is
#: a segment being written.
CHECK_PAUSE = 0.1
CHECK_STABLE_LOOKS = 2
CHECK_MAX_LOOKS = 20
#: The verdicts that an append in progress can produce (a prefix of a valid batch).
UNFINISHED = (TailState.TORN_TAIL, TailState.GARBAGE_TAIL, TailState.ZERO_TAIL,
              TailState.SHORT_FILE)
EXIT_HEALTHY, EXIT_DAMAGE, EXIT_CANNOT_CHECK = 0, 1, 2


T = TypeVar("T")


def _check_small_file(name: str, out: TextIO, read: Callable[[], T], ok: Callable[[T], str],
                      bad: str) -> int:
    """`queued check` of a file read whole (a checkpoint, a producer snapshot): 1 when it
    is unreadable (FileNotFoundError goes up: removed while checking)."""
    try:
        value = read()
    except FileNotFoundError:
        raise
    except (CorruptRecordError, OSError) as exc:
        print(f"BAD   {name}: " + bad.format(exc), file=out)
        return 1
    print(f"ok    {name}: {ok(value)}", file=out)
    return 0


def _look(path: Path, number: int, pause: Callable[[float], object]) -> tuple[Inspection, bool]:
    """inspect_segment, again while the tail is unfinished: (the last verdict, whether
    the file kept changing between looks, i.e. a server is appending to it)."""
    found = inspect_segment(path, number)
    changed = False
    stable = 0
    for _ in range(CHECK_MAX_LOOKS):
        if found.state not in UNFINISHED or stable >= CHECK_STABLE_LOOKS:
            break
        pause(CHECK_PAUSE)
        again = inspect_segment(path, number)
        if (again.file_size, again.segment.inode) == (found.file_size, found.segment.inode):
            stable += 1
        else:
            changed, stable = True, 0
        found = again
    return found, changed and stable < CHECK_STABLE_LOOKS


def check(directory: Path, out: TextIO, *,
          pause: Callable[[float], object] = time.sleep) -> int:
    """Verify every journal file of a data directory: 0 when all are sound, 1 when
    something is damaged (OSError, e.g. an unreadable directory, is the caller's 2).

    Safe next to a running server: each segment is judged on one consistent prefix
    (inspect_segment reads no further than the file's size when opened); an unfinished
    batch at the end of a segment that keeps growing is being written, not damage; a
    file removed while we check (retired, compacted, its queue deleted) is skipped.
    """
    problems = busy = gone = 0
    names = sorted(os.listdir(directory))
    for name in names:
        parsed = jf.parse_file_name(name)
        path = directory / name
        if parsed is None or not path.is_file():
            continue
        if parsed.role is jf.FileRole.TEMP:
            print(f"WARN  {name}: temporary file (a checkpoint or compaction being written, "
                  f"or left by a crash: recovery removes it)", file=out)
            continue
        try:
            if parsed.role is jf.FileRole.CHECKPOINT:
                problems += _check_small_file(
                    name, out, functools.partial(read_checkpoint, path),
                    lambda cp: f"head={cp.head} done={len(cp.done)} ids",
                    "unreadable checkpoint ({}); recovery replays this reader from the "
                    "oldest segment")
                continue
            if parsed.role is jf.FileRole.DEDUP:
                problems += _check_small_file(
                    name, out, functools.partial(read_dedup, path),
                    lambda marks: f"{len(marks)} deduplication keys",
                    "unreadable key snapshot ({}); its keys fall back to at-least-once")
                continue
            if parsed.role is jf.FileRole.PRODUCERS:
                problems += _check_small_file(
                    name, out, functools.partial(read_producers, path),
                    lambda marks: f"{len(marks)} producers",
                    "unreadable producer snapshot ({}); its producers fall back to "
                    "at-least-once")
                continue
            found, growing = _look(path, parsed.number, pause)
        except FileNotFoundError:
            gone += 1
            print(f"gone  {name}: removed while checking (retired, compacted or deleted by "
                  f"the server)", file=out)
            continue
        seg = found.segment
        summary = f"{seg.count} items, ids {seg.first_id}..{seg.last_id}, {found.good_end} bytes"
        if found.state is TailState.CLEAN:
            sealed = "" if seg.sealed else " (seed format, no check records)"
            print(f"ok    {name}: {summary}{sealed}", file=out)
            continue
        if growing and found.state in UNFINISHED:
            busy += 1
            print(f"busy  {name}: a batch is being written at offset {found.good_end} (the "
                  f"file grew while checked); verified so far: {summary}", file=out)
            continue
        problems += 1
        if found.state is TailState.MIDDLE_CORRUPTION:
            print(f"BAD   {name}: CORRUPT at offset {found.good_end}: {found.reason}; "
                  f"recovery refuses to start (or quarantines, by config)", file=out)
        else:
            print(f"BAD   {name}: {found.reason}; recovery cuts {found.problem_bytes} bytes "
                  f"at offset {found.good_end} ({summary})", file=out)
    print(f"{len(names)} entries checked, {problems} with problems", file=out)
    if busy or gone:
        print(f"note: the directory changed while it was checked (a running server is using "
              f"it): {busy} segments were being written, {gone} files were removed; each "
              f"file was checked as far as it was complete", file=out)
    return EXIT_DAMAGE if problems else EXIT_HEALTHY


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="queued", description="queued: a durable queue server",
        epilog=CLIENT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"queued {__version__}")
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
                    "in the users file (see the README's Security section).")
    add_client_commands(sub)
    for name in ("dump", "check", "serve", *CLIENT_COMMANDS):  # for parse_args's errors
        command_parser = sub.choices[name]
        command_parser.set_defaults(command_parser=command_parser)
    return parser


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
    log.info("queued %s starting (pid %d) with this config:\n%s", __version__, os.getpid(),
             qconfig.describe(config), extra={"event": "starting", "version": __version__})
    _limit_malloc_arenas()
    _tune_gc()
    try:
        trio.run(partial(serve, config, handle_signals=True))
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


M_ARENA_MAX = -8  # glibc's mallopt parameter number


def _limit_malloc_arenas() -> None:
    """One malloc arena for all threads (glibc; a no-op elsewhere).

    Read-behind decodes items in a worker thread and the event loop frees them; with
    glibc's per-thread arenas that kept ~20 MiB more resident than the items need.
    Measured with bench/load.py --rss-only: dequeue peak 61 -> 42 MiB (baseline 30).
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_ARENA_MAX, 1)
    except (OSError, AttributeError):
        pass


#: gc thresholds for the server (CPython's default is 700, 10, 10).
GC_THRESHOLDS = (50_000, 20, 20)


def _tune_gc() -> None:
    """Collect the young generation less often.

    Every queued item is a tracked object (its Put); with CPython's default
    threshold of 700 allocations the collector ran about once per 100-item RPC
    batch and took ~16% of the event loop's CPU (perf, 4 connections putting
    64 B items in batches of 100). Long-lived items still cost their full
    collections (CPython runs one after 25% growth), but those are rarer.
    """
    gc.set_threshold(*GC_THRESHOLDS)


def _single(exc: BaseException) -> BaseException:
    """The one exception inside nested single-member exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


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


# -- client commands: put, get, peek, stats, flush, delete -------------------------------------

EXIT_OK, EXIT_SERVER_ERROR, EXIT_USAGE, EXIT_CONNECT = 0, 1, 2, 3
CLIENT_EPILOG = f"""\
client commands (put, get, peek, stats, flush, delete) talk MessagePack-RPC to
--server HOST:PORT (default 127.0.0.1:{DEFAULT_PORT}; repeat it or separate with commas
for several servers: puts are spread over them, starting at a random one, and fail over
to the next when one is down; gets try each). --server dns://NAME:PORT means every
address NAME resolves to (a Kubernetes headless Service); dns+srv://_svc._tcp.NAME reads
SRV records; add ?nameserver=HOST:PORT to ask that DNS server instead of the system's.

exit codes: 0 ok (also when the reader of stdout stops early, as `| head -3` does: `get`
confirms only the items the reader took, the others go back to the queue);
1 the server answered with an error (bad queue name, queue full...), or `get` could not
confirm items (they will be delivered again);
2 usage error; 3 cannot connect to any server, or no reply in time."""
#: Items per put when reading stdin, and per get.
BATCH = 1000
#: An open read of `get` returns to the queue if not confirmed in this time.
OPEN_READ_MS = 60_000
#: `get` stops waiting for stdout's reader this long before its open reads time out.
OPEN_READ_MARGIN_MS = 5_000
#: The client commands' help on TLS and logins, after CLIENT_EPILOG.
SECURITY_EPILOG = """

TLS: --tls verifies the servers' certificates with the system's CAs, --ca FILE with
that CA bundle; --cert FILE (and --key FILE) is a client certificate for servers that
want one. --user NAME logs in; the password comes from the environment variable
QUEUED_PASSWORD, else it is asked at the terminal (never on the command line). Wrong
credentials or a missing permission exit 1; --user without a password and no terminal
to ask at, or certificate files that cannot be loaded, exit 2; a failed TLS handshake
exits 3."""


def add_client_commands(sub: Any) -> None:
    """Add the client subcommands to `sub` (argparse's subparsers action)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--server", action="append", metavar="HOST:PORT",
                        help=f"a server, or dns://NAME:PORT for every address of NAME; "
                             f"repeat or comma-separate for several "
                             f"(default 127.0.0.1:{DEFAULT_PORT})")
    common.add_argument("--tls", action="store_true",
                        help="speak TLS, verifying the servers with the system's CAs")
    common.add_argument("--ca", metavar="FILE",
                        help="verify the servers' certificates with this PEM CA bundle "
                             "(implies --tls)")
    common.add_argument("--cert", metavar="FILE",
                        help="a PEM client certificate, for servers that want one "
                             "(implies --tls)")
    common.add_argument("--key", metavar="FILE",
                        help="the private key of --cert (if not in its file)")
    common.add_argument("--user", metavar="NAME",
                        help="log in as NAME; the password comes from $QUEUED_PASSWORD, "
                             "else a prompt at the terminal")
    timeout = argparse.ArgumentParser(add_help=False)
    timeout.add_argument("--timeout", type=_non_negative, default=10_000, metavar="MS",
                         help="give up connecting or waiting for a reply after MS "
                              "milliseconds (default 10000)")

    def add(name: str, helptext: str, *parents: argparse.ArgumentParser,
            description: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(  # type: ignore[no-any-return]
            name, help=helptext, description=textwrap.fill(description or helptext, 80),
            parents=[common, *parents], epilog=CLIENT_EPILOG + SECURITY_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter)

    p = add("put", "put items (DATA arguments, or one item per line of stdin)", timeout,
            description="Put each DATA argument as one item; with no DATA, put each line of "
                        f"stdin (without its newline) as one item, {BATCH} lines per call.")
    p.add_argument("queue")
    p.add_argument("data", nargs="*", help="items (as bytes from the command line)")
    p.add_argument("--expiration", type=_non_negative, default=0, metavar="MS",
                   help="items expire MS milliseconds from now (default 0: never)")
    p.add_argument("--delay", type=_delay, default=0, metavar="MS",
                   help="items stay invisible for MS milliseconds (default 0: none)")
    p = add("get", "get items and print each on its own line",
            description="Print up to N items, each followed by a newline (raw bytes; an item "
                        "containing a newline is ambiguous). Stops early when the queue "
                        "stays empty for --timeout. Items are read with reliable reads and "
                        "confirmed once written (into a pipe: once its reader has read "
                        "them), so a reader that stops early (| head -1) takes from the "
                        "queue only what it read; the rest goes back.")
    p.add_argument("queue", help="QUEUE, or QUEUE+READER for a fanout reader")
    p.add_argument("-n", type=_positive, default=1, metavar="N",
                   help="how many items at most (default 1)")
    p.add_argument("--open", action="store_true",
                   help="reliable reads (the default; kept for scripts that pass it)")
    p.add_argument("--timeout", type=_non_negative, default=0, metavar="MS",
                   help="wait up to MS milliseconds for items to arrive (default 0: "
                        "only what is there now); connecting and replies get 10 s more")
    p = add("peek", "show a queue's head item and numbers (summed over servers)", timeout)
    p.add_argument("queue", help="QUEUE, or QUEUE+READER for a fanout reader")
    p = add("stats", "show server and queue statistics", timeout)
    p.add_argument("--json", action="store_true", help="print one JSON object, by server")
    p = add("flush", "remove every item of a queue", timeout)
    p.add_argument("queue", help="QUEUE, or QUEUE+READER for a fanout reader")
    p = add("delete", "delete a queue and its journal", timeout)
    p.add_argument("queue", help="QUEUE, or QUEUE+READER for a fanout reader")
    p = add("move", "move items from one queue to another (redrive dead letters; admin)",
            timeout, description="Move items from SOURCE to DESTINATION in delivery order, each "
                        "durable in DESTINATION (with its error count and flags) before it "
                        "leaves SOURCE, on every server (--server picks some). Prints how "
                        "many moved. An admin command. --timeout bounds connecting; the "
                        "move itself may take as long as its rate needs.")
    p.add_argument("source", help="SOURCE, or SOURCE+READER for a fanout reader")
    p.add_argument("destination")
    p.add_argument("-n", type=_non_negative, default=0, metavar="N",
                   help="at most N items per server (default 0: all there)")
    p.add_argument("--rate", type=_non_negative, default=0, metavar="PER_S",
                   help="at most PER_S items a second per server (default 0: no limit)")
    p = add("pause", "pause a queue: puts go on, gets wait until resume (admin)", timeout)
    p.add_argument("queue")
    p = add("resume", "resume a paused queue (admin)", timeout)
    p.add_argument("queue")


def _whole(text: str, least: int) -> int:
    """`text` as an int >= `least`; argparse prefixes the error with the argument's name."""
    rule = f"a whole number, {least} or more"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {rule}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{text} is too small: it must be {rule}")
    return value


def _non_negative(text: str) -> int:
    return _whole(text, 0)


def _delay(text: str) -> int:
    value = _whole(text, 0)
    if value > jf.MAX_DELAY_MS:
        raise argparse.ArgumentTypeError(f"{text} is too large: at most {jf.MAX_DELAY_MS} ms "
                                         "(10 years)")
    return value


def _positive(text: str) -> int:
    return _whole(text, 1)


def client_command(args: argparse.Namespace) -> int:
    """Run a client subcommand; the exit codes are in CLIENT_EPILOG."""
    prog = f"queued {args.command}"
    try:
        servers = parse_servers(args.server or f"127.0.0.1:{DEFAULT_PORT}")
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        tls = _tls_context(args)
        password = _password(args)
    except _Usage as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    seconds = 10.0 if args.command == "get" else args.timeout / 1000
    try:
        with Client([a for a, _, _ in servers], connect_timeout=seconds,
                    read_timeout=seconds, tls=tls, user=args.user,
                    password=password) as client:
            return CLIENT_COMMANDS[args.command](client, args)
    except (ConnectionFailed, Timeout, AmbiguousPut) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_CONNECT
    except AuthFailed as exc:
        print(f"{prog}: authentication failed: wrong password, or no user {args.user!r} "
              f"({exc.server})", file=sys.stderr)
        return EXIT_SERVER_ERROR
    except Unauthenticated as exc:
        print(f"{prog}: the server wants a login: give --user NAME (the password in "
              f"QUEUED_PASSWORD) ({exc.server})", file=sys.stderr)
        return EXIT_SERVER_ERROR
    except ClientError as exc:  # an error reply (RpcCallError), or a reply we cannot read
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_SERVER_ERROR


class _Usage(Exception):
    """A client command's TLS or login options cannot be used (exit 2)."""


def _tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The client TLS context --tls, --ca, --cert and --key ask for; None for plaintext."""
    if args.key and not args.cert:
        raise _Usage("--key needs --cert (the client certificate it belongs to)")
    if not (args.tls or args.ca or args.cert):
        return None
    try:
        return tls_files_context(args.ca, args.cert, args.key)
    except ValueError as exc:
        raise _Usage(str(exc)) from None


def _password(args: argparse.Namespace) -> str | None:
    """--user's password: $QUEUED_PASSWORD, else asked at the terminal; never echoed."""
    if args.user is None:
        return None
    password = os.environ.get("QUEUED_PASSWORD")
    if password is not None:
        return password
    if not sys.stdin.isatty():
        raise _Usage(f"--user {args.user} needs a password: set QUEUED_PASSWORD (stdin is "
                     "not a terminal to ask at)")
    try:
        return getpass.getpass(f"password for {args.user}: ")
    except EOFError:
        raise _Usage("no password given") from None


def _progress(total: int | None, unit: str, *, also_stdout: bool = False) -> Any:
    """A tqdm bar on stderr, shown only when stderr is a terminal (and, for output that goes
    to stdout, stdout is not the same terminal) and the transfer takes over half a second."""
    from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

    hidden = not sys.stderr.isatty() or (also_stdout and sys.stdout.isatty())
    return tqdm(total=total, unit=unit, unit_scale=True, file=sys.stderr, disable=hidden,
                delay=0.5, leave=False)


def _stdin_lines(stream: BinaryIO) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for line in stream:
        batch.append(line[:-1] if line.endswith(b"\n") else line)
        if len(batch) >= BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def put_command(client: Client, args: argparse.Namespace) -> int:
    if args.data:
        data = [os.fsencode(d) for d in args.data]
        batches: Iterator[list[bytes]] = (data[i:i + BATCH] for i in range(0, len(data), BATCH))
    else:
        batches = _stdin_lines(sys.stdin.buffer)
    stored = 0
    with _progress(None, "item") as bar:
        for batch in batches:
            stored += client.put(args.queue, batch, args.expiration, delay_ms=args.delay)
            bar.update(len(batch))
    print(f"stored {stored} item{'s' if stored != 1 else ''}", file=sys.stderr)
    return EXIT_OK


def get_command(client: Client, args: argparse.Namespace) -> int:
    """Open reads, each confirmed once stdout's reader has taken its line: items written
    to a pipe whose reader then stops (`| head -1`), and items not written at all, are
    not confirmed and go back to the queue when the connection closes."""
    out = Stdout(sys.stdout.buffer)
    deadline = time.monotonic() + args.timeout / 1000
    # Into a pipe, a few lines at first, each lot once the last was read: a reader that
    # wants one line finds only one to read, and a fast reader soon gets whole batches.
    lot = 1 if out.pipe else BATCH
    sent: deque[tuple[Item, int]] = deque()  # written, not confirmed: (item, end offset)
    got = refused = 0
    end = "read"
    with _progress(args.n if args.n > 1 else None, "item", also_stdout=True) as bar:
        while got < args.n and end == "read":
            wait = max(0, int((deadline - time.monotonic()) * 1000))
            items: list[Item] = client.get(args.queue, min(args.n - got, BATCH), wait,
                                           OPEN_READ_MS)
            if not items:
                break
            got += len(items)
            give_up = time.monotonic() + (OPEN_READ_MS - OPEN_READ_MARGIN_MS) / 1000
            at = 0
            while at < len(items) and end == "read":
                part = items[at:at + lot]
                at += len(part)
                offset = out.written
                try:
                    out.write(b"".join(item.data + b"\n" for item in part))
                except BrokenPipeError:
                    end = "gone"
                    break
                for item in part:
                    offset += len(item.data) + 1
                    sent.append((item, offset))
                end, n = _confirm_taken(client, out, sent, give_up, bar)
                refused += n
                lot = min(lot * 2, BATCH)
    if end == "gone":  # the reader's choice, not an error; silence the flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if end == "stalled":
        print(f"queued get: {len(sent)} items written to stdout were not read within "
              f"{(OPEN_READ_MS - OPEN_READ_MARGIN_MS) // 1000} s; they go back to the queue "
              "(and the reader may still read them)", file=sys.stderr)
        return EXIT_SERVER_ERROR
    if refused:
        print(f"queued get: {refused} items could not be confirmed and will be delivered "
              "again", file=sys.stderr)
        return EXIT_SERVER_ERROR
    return EXIT_OK


def _confirm_taken(client: Client, out: Stdout, sent: deque[tuple[Item, int]],
                   give_up: float, bar: Any) -> tuple[str, int]:
    """Confirm the items of `sent` whose lines stdout's reader has taken, until it has
    taken them all ("read"), closed its end ("gone"), or `give_up` came first ("stalled");
    returns that and how many confirms the server refused."""
    refused = 0
    pause_ms = 1
    gone = False
    while True:
        taken = out.taken()
        done = []
        while sent and sent[0][1] <= taken:
            done.append(sent.popleft()[0])
        if done:
            refused += len(done) - client.confirm(done)
            bar.update(len(done))
        if not sent:
            return "read", refused
        if gone:  # (what it read before it went was confirmed just above)
            return "gone", refused
        if time.monotonic() >= give_up:
            return "stalled", refused
        gone = out.reader_gone(pause_ms)
        pause_ms = 1 if done else min(pause_ms * 2, 50)


def peek_command(client: Client, args: argparse.Namespace) -> int:
    info = client.peek(args.queue)
    print(f"queue: {info.queue}")
    if info.head is None:
        print("head: (none)")
    else:
        print(f"head: id={info.head.id} size={len(info.head.data)} "
              f"data={_preview(info.head.data)} server={info.head.server}")
    for key, value in sorted(info.stats.items()):
        print(f"{key}: {value}")
    return EXIT_OK


#: The queue columns of the human `stats` table; `--json` has them all.
STATS_COLUMNS = ("items", "bytes", "open_transactions", "waiters", "total_items",
                 "expired_items", "discarded", "age_msec")


def stats_command(client: Client, args: argparse.Namespace) -> int:
    stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True, default=repr))
        return EXIT_OK
    for server, answer in stats.items():
        print(f"== {server}")
        for key, value in sorted(dict(answer.get("server", {})).items()):
            print(f"  {key:<24} {value}")
        queues: dict[str, dict[str, Any]] = dict(answer.get("queues", {}))
        if not queues:
            print("  (no queues)")
            continue
        rows: list[tuple[str, ...]] = [("queue", *STATS_COLUMNS)]
        rows += [(name, *(str(q.get(c, "")) for c in STATS_COLUMNS))
                 for name, q in sorted(queues.items())]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                                   for i, (cell, w) in enumerate(zip(row, widths, strict=True))))
    return EXIT_OK


def flush_command(client: Client, args: argparse.Namespace) -> int:
    n = client.flush(args.queue)
    print(f"flushed {n} item{'s' if n != 1 else ''}")
    return EXIT_OK


def delete_command(client: Client, args: argparse.Namespace) -> int:
    print("deleted" if client.delete(args.queue) else "no such queue")
    return EXIT_OK


def move_command(client: Client, args: argparse.Namespace) -> int:
    moved = client.move(args.source, args.destination, args.n, args.rate)
    print(f"moved {moved} item{'s' if moved != 1 else ''}")
    return EXIT_OK


def pause_command(client: Client, args: argparse.Namespace) -> int:
    (client.pause if args.command == "pause" else client.resume)(args.queue)
    print(f"{args.queue}: {'paused' if args.command == 'pause' else 'resumed'}")
    return EXIT_OK


CLIENT_COMMANDS: dict[str, Callable[[Client, argparse.Namespace], int]] = {
    "put": put_command,
    "get": get_command,
    "peek": peek_command,
    "stats": stats_command,
    "flush": flush_command,
    "delete": delete_command,
    "move": move_command,
    "pause": pause_command,
    "resume": pause_command,
}


if __name__ == "__main__":
    raise SystemExit(main())
