"""Files: journals, the writer's write/fsync rounds, the data directory, recovery,
compaction and read-only scans. Imports the core and config, never the broker or the server.
"""
