"""MkDocs hooks (``mkdocs.yml``'s ``hooks:``): the images a page shows from the repository outside ``docs/``.

A page in ``docs/`` shows a figure with a path relative to itself, e.g. ``docs/evaluation.md``'s
``![...](../benchmarks/results/ruler_c3f5e3b_smollm2_4k/accuracy_vs_density.png)``: right on GitHub and in an editor,
but outside the site's ``docs_dir``. ``on_files`` adds each such image to the site, under ``assets/repo/`` + its path
in the repository, and ``on_page_markdown`` points the page's link there; the pages keep their paths and nothing is
copied into ``docs/``. Only images that exist: any other link out of ``docs/`` stays a broken link, which
``mkdocs build --strict`` refuses.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

IMAGE = re.compile(r"(!\[[^\]]*\]\()([^)\s]+)")  # ![alt](target: the target is group 2
SUFFIXES = {".png", ".svg", ".jpg", ".jpeg", ".gif", ".webp"}
PREFIX = "assets/repo"


def _repository_path(page_uri: str, target: str, config) -> str | None:
    """The repository path of an image ``target`` that ``page_uri`` links out of ``docs_dir``; None for any other."""
    if "://" in target or target.startswith(("/", "#", "data:")):
        return None
    docs = Path(config.docs_dir).resolve()
    root = Path(config.config_file_path).resolve().parent
    path = (docs / posixpath.dirname(page_uri) / target).resolve()
    if path.suffix.lower() not in SUFFIXES or path.is_relative_to(docs) or not path.is_relative_to(root):
        return None
    return path.relative_to(root).as_posix() if path.is_file() else None


def on_files(files, config):
    root = Path(config.config_file_path).resolve().parent
    for page in files.documentation_pages():
        text = Path(page.abs_src_path).read_text(encoding="utf-8")
        for match in IMAGE.finditer(text):
            path = _repository_path(page.src_uri, match.group(2), config)
            if path is not None and files.get_file_from_path(f"{PREFIX}/{path}") is None:
                files.append(File.generated(config, f"{PREFIX}/{path}", abs_src_path=str(root / path)))
    return files


def on_page_markdown(markdown, page, config, files):
    here = posixpath.dirname(page.file.src_uri) or "."

    def relink(match: re.Match) -> str:
        path = _repository_path(page.file.src_uri, match.group(2), config)
        if path is None:
            return match.group(0)
        return match.group(1) + posixpath.relpath(f"{PREFIX}/{path}", here)

    return IMAGE.sub(relink, markdown)
