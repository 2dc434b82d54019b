"""MkDocs hooks for the documentation site (``make docs``).

* The README is the site's front page and CHANGELOG.md its changelog: both stay at the
  top of the repository, where people land, and are read from there.
* A link is written for GitHub, relative to the file it is in. One to a page of
  ``docs/`` is made relative to the page on the site; one to another file of the
  repository (source, the Dockerfile, an example) becomes that file's path, in code,
  as the site carries no copy of the source. A link to nothing is left as it is, so
  the strict build fails on it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

# the repository's files that are pages of the site: (file, page)
FRONT = (("README.md", "index.md"), ("CHANGELOG.md", "changelog.md"))
LINK = re.compile(r"(!?)\[([^\]\n]*)\]\(([^)\s]+)\)")
EXTERNAL = re.compile(r"^([a-z][a-z0-9+.-]*:|#|/)")


def on_files(files: Files, config: Any) -> Files:
    root = Path(config.config_file_path).parent
    for name, page in FRONT:
        files.append(File.generated(config, page, abs_src_path=str(root / name)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    root = Path(config.config_file_path).parent.resolve()
    docs = Path(config.docs_dir).resolve()
    source = Path(page.file.abs_src_path).resolve()
    here = posixpath.dirname(page.file.src_uri) or "."

    def relinked(match: re.Match[str]) -> str:
        bang, text, target = match.groups()
        if EXTERNAL.match(target):
            return match.group(0)
        path, _, anchor = target.partition("#")
        real = (source.parent / path).resolve()
        suffix = f"#{anchor}" if anchor else ""
        if real.is_relative_to(docs):
            to = posixpath.relpath(real.relative_to(docs).as_posix(), here)
            return f"{bang}[{text}]({to}{suffix})"
        for name, page_uri in FRONT:
            if real == root / name:
                return f"{bang}[{text}]({posixpath.relpath(page_uri, here)}{suffix})"
        if real.exists() and real.is_relative_to(root) and not bang:
            shown = real.relative_to(root).as_posix()
            return text if shown in text else f"{text} (`{shown}`)"
        return match.group(0)

    return LINK.sub(relinked, markdown)
