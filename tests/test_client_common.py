"""What both clients share (queued.client.common), pure: every error code of the RPC port
becomes its own exception, carrying the code, the message and the server."""

from __future__ import annotations

import pytest

from queued.client import (
    RpcCallError,
)
from queued.client.common import ERRORS, call_error
from queued.wire.rpc_protocol import (
    ErrorCode,
)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_error_code_has_its_exception(code: ErrorCode) -> None:
    exc = call_error([int(code), "why"], "h:1")
    assert type(exc) is ERRORS[code] and exc.code is code
    assert exc.message == "why" and exc.server == "h:1"
    assert code.name in str(exc)
    unknown = call_error([99, "new"], "h:1")
    assert type(unknown) is RpcCallError and unknown.code == 99
