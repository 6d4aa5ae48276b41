"""The pure layer: formats, parsers, commands, the queue state machine, errors.

Nothing here does I/O: no trio, socket, os or time imports (tests/test_layering.py
checks it). It is what hypothesis tests hammer and what Spark reuses.
"""
