"""What every client command shares: the options that reach the servers (--server, TLS, a
login, --timeout), their help, the argument types, and the run of one command with a
`Client` whose failures become the exit codes of CLIENT_EPILOG.

Owns connecting and the exit codes; what each command does is queued.cli.client_commands'.
It never reads a password from the command line (the environment, or the terminal).
"""

from __future__ import annotations

import argparse
import getpass
import os
import ssl
import sys
from collections.abc import Callable

from queued.client import (
    DEFAULT_PORT,
    AmbiguousPut,
    AuthFailed,
    Client,
    ClientError,
    ConnectionFailed,
    Timeout,
    Unauthenticated,
    parse_servers,
)
from queued.client.credentials import tls_files_context
from queued.journal import format as jf

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
#: The client commands' help on TLS and logins, after CLIENT_EPILOG.
SECURITY_EPILOG = """

TLS: --tls verifies the servers' certificates with the system's CAs, --ca FILE with
that CA bundle; --cert FILE (and --key FILE) is a client certificate for servers that
want one. --user NAME logs in; the password comes from the environment variable
QUEUED_PASSWORD, else it is asked at the terminal (never on the command line). Wrong
credentials or a missing permission exit 1; --user without a password and no terminal
to ask at, or certificate files that cannot be loaded, exit 2; a failed TLS handshake
exits 3."""



def shared_options() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The parent parsers of the client commands: every command's (servers, TLS, login),
    and --timeout for those that wait for one reply."""
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
    timeout.add_argument("--timeout", type=non_negative, default=10_000, metavar="MS",
                         help="give up connecting or waiting for a reply after MS "
                              "milliseconds (default 10000)")
    return common, timeout


def whole(text: str, least: int) -> int:
    """`text` as an int >= `least`; argparse prefixes the error with the argument's name."""
    rule = f"a whole number, {least} or more"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {rule}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{text} is too small: it must be {rule}")
    return value


def non_negative(text: str) -> int:
    return whole(text, 0)


def delay(text: str) -> int:
    value = whole(text, 0)
    if value > jf.MAX_DELAY_MS:
        raise argparse.ArgumentTypeError(f"{text} is too large: at most {jf.MAX_DELAY_MS} ms "
                                         "(10 years)")
    return value


def positive(text: str) -> int:
    return whole(text, 1)



def run_client(args: argparse.Namespace, command: Callable[[Client, argparse.Namespace], int]
               ) -> int:
    """Run `command` with a Client for the servers of `args`; the exit codes are in
    CLIENT_EPILOG."""
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
            return command(client, args)
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

