"""The journal format (seed 002, Kestrel's, plus our extension records): record bytes
(`records`), the incremental decoder (`decoder`), file names (`names`), and all of them in
one import (`format`).

PURE: bytes in, records out; no files. Storage reads and writes files with it; Spark and the
CLI's journal tools decode with it.
"""
