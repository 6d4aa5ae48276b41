"""The wire: every protocol's sans-IO codec and the protocol-neutral commands they map to.

PURE: no trio, socket, os or time (tests/test_layering.py checks it). Holds the receive
buffer and line-parser base (`parsing`), the memcache, text and MessagePack-RPC codecs
(`*_protocol`) and their command tables (`*_commands`), the commands and replies a session
runs (`commands`), who may run them (`access`), and the TLS record loop (`tls_records`).
Imports queued.sansio, queued.errors, queued.stats and the journal's item type only.
"""
