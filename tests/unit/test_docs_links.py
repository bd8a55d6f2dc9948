"""Every relative link and image in README.md and docs/ resolves to a file of the repository
(issue 23, item 7: charts that docs/performance.md showed were left out by .gitignore, and a
reader of a fresh clone saw broken links)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def _repository_files() -> set[str] | None:
    """The files git tracks (None outside a git checkout: then existing files count)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(done.stdout.split("\0")) - {""}


def broken_links(document: Path, text: str, tracked: set[str] | None) -> list[str]:
    """The relative link targets in ``text`` (the document at ``document``) that name no file or
    folder of the repository."""
    folders = {parent.as_posix() for name in tracked or () for parent in Path(name).parents}
    broken = []
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor in the same page
        path = (document.parent / target.split("#")[0]).resolve()
        try:
            name = path.relative_to(ROOT).as_posix()
        except ValueError:  # outside the repository
            broken.append(target)
            continue
        if not (path.exists() if tracked is None else name in tracked or name in folders):
            broken.append(target)
    return broken


@pytest.mark.parametrize("document", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda path: path.name)
def test_every_relative_link_resolves(document):
    assert broken_links(document, document.read_text(encoding="utf-8"), _repository_files()) == []


@pytest.mark.parametrize("text, broken", [
    ("![chart](img/none.png) and [ok](../README.md#set-up)", ["img/none.png"]),
    ("[url](https://example.org/x.png) [anchor](#options) [folder](../tests)", []),
    ("[out](../../outside.md)", ["../../outside.md"]),
])
def test_the_check_finds_what_is_missing(text, broken):
    assert broken_links(ROOT / "docs" / "x.md", text, {"README.md", "tests/cluster.py"}) == broken
