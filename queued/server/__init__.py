"""The network edge: listeners, the one session every queue protocol runs in, HTTP and
metrics. Only the CLI (and tests) import it.
"""
