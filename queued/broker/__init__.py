"""The queues of one server, with no sockets: `broker.Broker` (what sessions call:
put, get, confirm, abort, flush, delete, stats), the queue registry, each queue's
delivery and read-behind, reliable reads, and `upkeep` (the background work and
`open_broker`). Imports storage, config and the core; never the server.
"""
