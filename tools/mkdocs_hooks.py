"""MkDocs hooks (mkdocs.yml `hooks:`): the README is the site's front page.

README.md lives at the top of the repository, where GitHub shows it, and links to the
pages as `docs/<page>.md`. The site gets it as `index.md` with those links made
relative to docs/, so the front page has one source and `mkdocs build --strict` checks
its links and anchors like every page's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"
#: A Markdown link or image target inside docs/, as the README writes it.
DOCS_LINK = re.compile(r"\]\(docs/")


def front_page(readme: str) -> str:
    """The README as docs/index.md sees it: `](docs/x)` becomes `](x)`."""
    return DOCS_LINK.sub("](", readme)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, "index.md", content=front_page(README.read_text())))
    return files
