"""The client commands: put, get, peek, stats, flush, delete, move, pause and resume.

Owns each command's arguments, its calls through the blocking `queued.client.Client` and
its human-readable output; connecting, TLS, logins and the exit codes are
queued.cli.client_options'. `get` confirms an item only once stdout's reader took it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from queued.cli.client_options import (
    CLIENT_EPILOG,
    EXIT_OK,
    EXIT_SERVER_ERROR,
    SECURITY_EPILOG,
    delay,
    non_negative,
    positive,
    run_client,
    shared_options,
)
from queued.cli.journal_tools import preview
from queued.cli.stdout import Stdout
from queued.client import Client, Item

#: Items per put when reading stdin, and per get.
BATCH = 1000
#: An open read of `get` returns to the queue if not confirmed in this time.
OPEN_READ_MS = 60_000
#: `get` stops waiting for stdout's reader this long before its open reads time out.
OPEN_READ_MARGIN_MS = 5_000


def add_client_commands(sub: Any) -> None:
    """Add the client subcommands to `sub` (argparse's subparsers action)."""
    common, timeout = shared_options()

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
    p.add_argument("--expiration", type=non_negative, default=0, metavar="MS",
                   help="items expire MS milliseconds from now (default 0: never)")
    p.add_argument("--delay", type=delay, default=0, metavar="MS",
                   help="items stay invisible for MS milliseconds (default 0: none)")
    p.add_argument("--header", action="append", type=header, default=[],
                   metavar="KEY=VALUE", dest="headers",
                   help="a header every item carries (repeat for more; the value a string)")
    p = add("get", "get items and print each on its own line",
            description="Print up to N items, each followed by a newline (raw bytes; an item "
                        "containing a newline is ambiguous). Stops early when the queue "
                        "stays empty for --timeout. Items are read with reliable reads and "
                        "confirmed once written (into a pipe: once its reader has read "
                        "them), so a reader that stops early (| head -1) takes from the "
                        "queue only what it read; the rest goes back.")
    p.add_argument("queue", help="QUEUE, or QUEUE+READER for a fanout reader")
    p.add_argument("-n", type=positive, default=1, metavar="N",
                   help="how many items at most (default 1)")
    p.add_argument("--open", action="store_true",
                   help="reliable reads (the default; kept for scripts that pass it)")
    p.add_argument("--timeout", type=non_negative, default=0, metavar="MS",
                   help="wait up to MS milliseconds for items to arrive (default 0: "
                        "only what is there now); connecting and replies get 10 s more")
    p.add_argument("--headers", action="store_true",
                   help="print each item's headers before it, as one line of JSON (an "
                        "object; {} for none; bytes that are not UTF-8 \\x-escaped)")
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
    p.add_argument("-n", type=non_negative, default=0, metavar="N",
                   help="at most N items per server (default 0: all there)")
    p.add_argument("--rate", type=non_negative, default=0, metavar="PER_S",
                   help="at most PER_S items a second per server (default 0: no limit)")
    p = add("pause", "pause a queue: puts go on, gets wait until resume (admin)", timeout)
    p.add_argument("queue")
    p = add("resume", "resume a paused queue (admin)", timeout)
    p.add_argument("queue")


def client_command(args: argparse.Namespace) -> int:
    """Run a client subcommand; the exit codes are in CLIENT_EPILOG."""
    return run_client(args, CLIENT_COMMANDS[args.command])


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


def header(text: str) -> tuple[str, str]:
    """`--header KEY=VALUE`."""
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def headers_line(item: Item) -> bytes:
    """An item's headers as `get --headers` prints them: one line of JSON."""
    shown = {k: v if isinstance(v, str) else v.decode(errors="backslashreplace")
             for k, v in (item.headers or {}).items()}
    return json.dumps(shown, ensure_ascii=False).encode() + b"\n"


def put_command(client: Client, args: argparse.Namespace) -> int:
    if args.data:
        data = [os.fsencode(d) for d in args.data]
        batches: Iterator[list[bytes]] = (data[i:i + BATCH] for i in range(0, len(data), BATCH))
    else:
        batches = _stdin_lines(sys.stdin.buffer)
    stored = 0
    with _progress(None, "item") as bar:
        for batch in batches:
            stored += client.put(args.queue, batch, args.expiration, delay_ms=args.delay,
                                 headers=dict(args.headers) or None)
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
                                           OPEN_READ_MS, with_headers=args.headers)
            if not items:
                break
            got += len(items)
            give_up = time.monotonic() + (OPEN_READ_MS - OPEN_READ_MARGIN_MS) / 1000
            at = 0
            while at < len(items) and end == "read":
                part = items[at:at + lot]
                at += len(part)
                offset = out.written
                lines = [(headers_line(item) if args.headers else b"") + item.data + b"\n"
                         for item in part]
                try:
                    out.write(b"".join(lines))
                except BrokenPipeError:
                    end = "gone"
                    break
                for item, line in zip(part, lines, strict=True):
                    offset += len(line)
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
              f"data={preview(info.head.data)} server={info.head.server}")
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

