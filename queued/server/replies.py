"""What a route of the operations port answers: a status, a body and its headers.

Shared by `queued.server.http` (which sends them through h11) and
`queued.server.console` (which makes them); no I/O here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final

TEXT: Final = "text/plain; charset=utf-8"
JSON: Final = "application/json"


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = (("Content-Type", TEXT),)


def text(status: int, body: str) -> Reply:
    return Reply(status, body.encode())


def json_reply(status: int, doc: object) -> Reply:
    return Reply(status, json.dumps(doc, indent=1).encode() + b"\n", (("Content-Type", JSON),))
