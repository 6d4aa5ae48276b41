"""Opening a data directory for the length of a block: `async with open_data_dir(path)`.

Owns the data directory's lifetime around its user: recovery in a worker thread, the
writer loop in a nursery, the clean close on the way out. Kept out of
queued.storage.datadir because it is an async generator (`asynccontextmanager`), which
mypyc does not compile, and the data directory is compiled (docs/development.md
"Compiled with mypyc"). Never does any of the directory's work itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from queued.config.policies import DataDirConfig, JournalConfig
from queued.errors import NotSavedError
from queued.storage.datadir import DataDir


@asynccontextmanager
async def open_data_dir(
    path: str | Path,
    config: DataDirConfig | None = None,
    queue_config: Callable[[str], JournalConfig] | None = None,
) -> AsyncIterator[DataDir]:
    """Recover `path` (in a worker thread), run its writer, close it cleanly on exit
    (NotSavedError, not wrapped in an exception group, when a journal could not be)."""
    dd = await trio.to_thread.run_sync(DataDir.open, path, config, queue_config)
    unsaved: NotSavedError | None = None
    async with trio.open_nursery() as nursery:
        await nursery.start(dd.run)
        try:
            yield dd
        finally:
            try:
                await dd.aclose()
            except NotSavedError as exc:
                unsaved = exc  # raised below (after another failure, that one goes up)
    if unsaved is not None:
        raise unsaved
