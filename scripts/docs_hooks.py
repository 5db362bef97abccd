"""mkdocs hooks (mkdocs.yml `hooks:`): the documents that live beside the code, in the site.

The protocol (schema/README.md, schema/HTTP.md, schema/broky.fbs) stays where outside
client authors, the code and the tests find it, and bench/README.md and bench/results/
stay with the benchmarks that write them. `on_files` adds each to the site at its path
in the repository, so their own relative links (`broky.fbs`, `results/chaos.md`) work
as they do on disk.

Every page links to other files as the repository sees them (`../schema/README.md`
from docs/http.md, `../docs/operations/monitoring.md` from schema/HTTP.md), which is
right when browsing the repository; `on_page_markdown` rewrites each link that crosses
between docs/ and the files added here to where its target is in the site. A link to a
file that is neither under docs/ nor added here is left as written, and
`mkdocs build --strict` fails on it.
"""

from __future__ import annotations

import functools
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# Repository files published in the site at their own paths (globs, from the root).
BESIDE_THE_CODE = (
    "schema/README.md",
    "schema/HTTP.md",
    "schema/broky.fbs",
    "bench/README.md",
    "bench/results/*.md",
    "bench/results/*.png",
)

# [text](target) and ![alt](target), target without a scheme or a leading '#' or '/'.
LINK = re.compile(r"(\]\()(?![a-z][a-z0-9+.-]*:|#|/)([^)\s#]+)(#[^)\s]*)?(\s+\"[^\"]*\")?\)")


@functools.cache
def published() -> frozenset[str]:
    """The repository paths `on_files` adds to the site."""
    return frozenset(
        p.relative_to(ROOT).as_posix() for pattern in BESIDE_THE_CODE for p in ROOT.glob(pattern)
    )


def on_files(files: Files, config: Any, **_: Any) -> Files:
    for path in sorted(published()):
        files.append(File.generated(config, path, abs_src_path=str(ROOT / path)))
    return files


def site_uri(target: Path) -> str | None:
    """Where a file of the repository is in the site, or None when it is not there."""
    if target.is_relative_to(DOCS):
        return target.relative_to(DOCS).as_posix()
    if target.is_relative_to(ROOT) and target.relative_to(ROOT).as_posix() in published():
        return target.relative_to(ROOT).as_posix()
    return None


def rewrite_links(markdown: str, source: Path, src_uri: str) -> str:
    """`markdown` (of the file at `source`, `src_uri` in the site) with each link to a
    file of the repository pointed at that file's place in the site."""

    def point(match: re.Match[str]) -> str:
        uri = site_uri((source.parent / match.group(2)).resolve())
        if uri is None:
            return match.group(0)  # not in the site: as written (mkdocs says so)
        link = posixpath.relpath(uri, posixpath.dirname(src_uri) or ".")
        return f"{match.group(1)}{link}{match.group(3) or ''}{match.group(4) or ''})"

    return LINK.sub(point, markdown)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    source = page.file.abs_src_path
    return markdown if source is None else rewrite_links(markdown, Path(source).resolve(), page.file.src_uri)
