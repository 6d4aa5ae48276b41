"""Item headers in bytes: the block a HEADERS record holds and a `Put` keeps in memory.

Owns the block's layout. An item's headers (the rule: queued.sansio.header_entries) are
held from the put on as this one `bytes` object, the same in memory, in the HEADERS record
(extension kind 7) and in a compaction's rewrite, and turned into a map only for a reply
or a tool: a header costs its key and value and 5 bytes, no dict per item. b"" is "no
headers" (no record is written). PURE: no I/O.

Layout: entries in order, each `u8 type (0 bytes, 1 string), u16 key length, u16 value
length` (little-endian), then the key (UTF-8) and the value.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, Final

from queued.sansio import HeaderValue, header_entries

ENTRY: Final = struct.Struct("<BHH")  # value type, key length, value length
BYTES_VALUE: Final = 0
STRING_VALUE: Final = 1


def encode_headers(headers: Mapping[Any, Any] | None) -> bytes:
    """The block of `headers` (b"" for None or an empty map); ValueError when they break
    the rule (queued.sansio.header_entries says which)."""
    if headers is None:
        return b""
    parts: list[bytes] = []
    for key, raw, text in header_entries(headers):
        k = key.encode()
        parts += (ENTRY.pack(STRING_VALUE if text else BYTES_VALUE, len(k), len(raw)), k, raw)
    return b"".join(parts)


def _walk(block: bytes | bytearray | memoryview) -> list[tuple[str, bytes, bool]]:
    """(key, value bytes, was a string) of each entry; ValueError when the block's entries
    do not add up (the decoder reports such a record as corrupt)."""
    out: list[tuple[str, bytes, bool]] = []
    pos, n = 0, len(block)
    while pos < n:
        if pos + ENTRY.size > n:
            raise ValueError(f"headers block cut short at byte {pos} of {n}")
        kind, klen, vlen = ENTRY.unpack_from(block, pos)
        pos += ENTRY.size
        if kind > STRING_VALUE or pos + klen + vlen > n:
            raise ValueError(f"headers entry at byte {pos - ENTRY.size} does not add up")
        try:
            key = bytes(block[pos:pos + klen]).decode()
        except UnicodeDecodeError:
            raise ValueError("headers block with a key that is not UTF-8") from None
        pos += klen
        out.append((key, bytes(block[pos:pos + vlen]), kind == STRING_VALUE))
        pos += vlen
    return out


def check_headers_block(block: bytes | bytearray | memoryview) -> None:
    """Raise ValueError unless `block` is a well-formed headers block (its strings
    UTF-8). The limits are not checked: a later release may raise them."""
    for _, raw, text in _walk(block):
        if text:
            try:
                raw.decode()
            except UnicodeDecodeError:
                raise ValueError("headers block with a string value that is not UTF-8") from None


def decode_headers(block: bytes | bytearray | memoryview) -> dict[str, HeaderValue]:
    """The map a block holds: string values as strings, bytes as bytes (what RPC gets
    answer). A key given twice cannot be: a map has each once."""
    return {key: raw.decode(errors="replace") if text else raw
            for key, raw, text in _walk(block)}


def header_pairs(block: bytes | bytearray | memoryview) -> list[tuple[str, bytes]]:
    """(key, value bytes) of each entry, in order, strings as their UTF-8 (the Spark
    `headers` column: array<struct<key: string, value: binary>>, as Kafka's)."""
    return [(key, raw) for key, raw, _ in _walk(block)]


def headers_text(block: bytes | bytearray | memoryview) -> str:
    """One line for tools (queued dump, get --headers): key=value, ..., bytes values
    that are not printable text shown as hex."""
    shown = []
    for key, raw, text in _walk(block):
        if text:
            value = raw.decode(errors="replace")
        else:
            try:
                value = raw.decode("ascii")
                value = value if value.isprintable() else "0x" + raw.hex()
            except UnicodeDecodeError:
                value = "0x" + raw.hex()
        shown.append(f"{key}={value}")
    return ", ".join(shown)
