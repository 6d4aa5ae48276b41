"""The Python client of queued's MessagePack-RPC port: `Client` (blocking), `AsyncClient` (trio).

Users import from here; the implementation lives in `queued.client.sync`,
`queued.client.aio` and the pure `queued.client.core`.
"""

from queued.client.sync import *  # noqa: F403
from queued.client.sync import __all__ as __all__
