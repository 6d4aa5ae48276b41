"""Decrypting what a TLS object has buffered (queued.wire.tls_records.read_records), with
two real ssl.SSLObjects over memory BIOs and certificates made by trustme: every byte
once and in order whatever the chunking of the ciphertext, a short read that leaves the
rest buffered, the end at close_notify, and bytes that are not TLS returned as the error
after what came before them. The transports built on it: test_server_tls.py,
test_client_credentials.py."""

from __future__ import annotations

import contextlib
import ssl

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from security_util import Pki

from queued.wire.tls_records import read_records


class Pair:
    """A TLS client and server over memory BIOs, handshaken."""

    def __init__(self, pki: Pki) -> None:
        sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        sctx.load_cert_chain(pki.cert, pki.key)
        self.c_in, self.c_out, self.s_in, self.s_out = (ssl.MemoryBIO() for _ in range(4))
        self.client = pki.client().wrap_bio(self.c_in, self.c_out, server_hostname="127.0.0.1")
        self.server = sctx.wrap_bio(self.s_in, self.s_out, server_side=True)
        for _ in range(10):
            done = 0
            for side in (self.client, self.server):
                try:
                    side.do_handshake()
                    done += 1
                except ssl.SSLWantReadError:
                    pass
            self.s_in.write(self.c_out.read())
            self.c_in.write(self.s_out.read())
            if done == 2:
                return
        raise AssertionError("no handshake")

    def server_sends(self, data: bytes, *, close: bool = False) -> bytes:
        """The ciphertext the server sends for `data` (and its close_notify)."""
        self.server.write(data)
        if close:
            with contextlib.suppress(ssl.SSLWantReadError):
                self.server.unwrap()
        return self.s_out.read()


@pytest.fixture(scope="module")
def module_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(1, 9000), max_size=12))
def test_every_byte_once_in_order_whatever_the_chunking(module_pki: Pki,
                                                        cuts: list[int]) -> None:
    pair = Pair(module_pki)
    message = bytes(range(256)) * 200  # 50 KiB: four records
    wire = pair.server_sends(message, close=True)
    buf = bytearray(64 * 1024)
    got, ended, at = bytearray(), False, 0
    for cut in [*cuts, len(wire)]:
        pair.c_in.write(wire[at:at + cut])
        at += cut
        n, ended, error = read_records(pair.client, pair.c_in, memoryview(buf))
        assert error is None
        got += buf[:n]
        if ended or at >= len(wire):
            break
    assert bytes(got) == message and ended


def test_a_short_buffer_leaves_the_rest_for_the_next_call(module_pki: Pki) -> None:
    pair = Pair(module_pki)
    pair.c_in.write(pair.server_sends(b"abcdefghij"))
    small = bytearray(4)
    assert read_records(pair.client, pair.c_in, memoryview(small)) == (4, False, None)
    assert bytes(small) == b"abcd"
    rest = bytearray(100)
    assert read_records(pair.client, pair.c_in, memoryview(rest)) == (6, False, None)
    assert bytes(rest[:6]) == b"efghij"
    assert read_records(pair.client, pair.c_in, memoryview(rest)) == (0, False, None)


def test_bytes_that_are_not_tls_end_it_with_the_error_after_what_came_before(
        module_pki: Pki) -> None:
    pair = Pair(module_pki)
    pair.c_in.write(pair.server_sends(b"good") + b"GET / HTTP/1.1\r\n\r\n")
    buf = bytearray(100)
    n, ended, error = read_records(pair.client, pair.c_in, memoryview(buf))
    assert (bytes(buf[:n]), ended) == (b"good", True)
    assert isinstance(error, ssl.SSLError)
