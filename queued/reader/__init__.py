"""A reader of a queue as pure state: its items in memory (`state`, packed in `packed_items`),
open reads and their deadlines (`open_reads`), and the queue's producer table (`producers`).

PURE: no sockets, files, clocks or trio; the broker feeds it time and items.
"""
