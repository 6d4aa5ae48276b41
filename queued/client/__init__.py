"""The Python client of queued's MessagePack-RPC port: `Client` (blocking), `AsyncClient` (trio).

Users import from here. aio.py is the one implementation of both clients: sync.py is
generated from it (unasync.py); their I/O is io_trio's and io_sync's, and the
pure parts they share (errors, values, addresses, back-off, replies) are core's.
"""

from queued.client.aio import AsyncClient, AsyncConsumer
from queued.client.core import (
    DEFAULT_PORT,
    AmbiguousPut,
    AuthFailed,
    BadParams,
    BadQueueName,
    BadResponse,
    Busy,
    ClientClosed,
    ClientError,
    ClientStatistics,
    ConnectionFailed,
    Item,
    ItemTooLarge,
    JournalFull,
    Malformed,
    PermissionDenied,
    ProducerGap,
    QueueFull,
    QueueInfo,
    RpcCallError,
    ServerError,
    ServerStatistics,
    ShuttingDown,
    Timeout,
    TooLarge,
    TooManyOpenReads,
    TooManyQueues,
    Unauthenticated,
    UnknownMethod,
)
from queued.client.servers import parse_servers
from queued.client.sync import Client, Consumer

__all__ = [
    "DEFAULT_PORT",
    "AmbiguousPut",
    "AsyncClient",
    "AsyncConsumer",
    "AuthFailed",
    "BadParams",
    "BadQueueName",
    "BadResponse",
    "Busy",
    "Client",
    "ClientClosed",
    "ClientError",
    "ClientStatistics",
    "ConnectionFailed",
    "Consumer",
    "Item",
    "ItemTooLarge",
    "JournalFull",
    "Malformed",
    "PermissionDenied",
    "ProducerGap",
    "QueueFull",
    "QueueInfo",
    "RpcCallError",
    "ServerError",
    "ServerStatistics",
    "ShuttingDown",
    "Timeout",
    "TooLarge",
    "TooManyOpenReads",
    "TooManyQueues",
    "Unauthenticated",
    "UnknownMethod",
    "parse_servers",
]
