"""The docs stay true to the code: the config reference is current, every link resolves,
every `python -m` command they give names a module of this repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rftpipe.config.reference import REGENERATE, render

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# [text](target) and ![alt](target); the target ends at whitespace or ")".
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
# `python -m rftpipe.x.y`, `-m tools.x`, `-m jobs.x` (also after torchrun or .venv/bin/).
_MODULE = re.compile(r"-m\s+((?:rftpipe|jobs|tools)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def test_config_reference_is_current() -> None:
    current = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert current == render(), (
        f"docs/config.md is stale (the config schema changed); regenerate it with `{REGENERATE}`"
    )


def _relative_links(page: Path) -> list[str]:
    """Link targets in ``page`` outside code, without URLs, mail links and in-page anchors."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
    return [
        target
        for target in _LINK.findall(text)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")
    ]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    links = _relative_links(page)
    broken = [t for t in links if not (page.parent / t.split("#", 1)[0]).exists()]
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_link_finder_sees_links() -> None:
    """The link test above is not vacuous: the README links into docs/."""
    assert any(t.startswith("docs/") for t in _relative_links(ROOT / "README.md"))


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_commands_name_existing_modules(page: Path) -> None:
    """A module that moves (a package split) must take the docs' commands with it."""
    modules = set(_MODULE.findall(page.read_text(encoding="utf-8")))
    missing = [
        m
        for m in sorted(modules)
        if not (ROOT / f"{m.replace('.', '/')}.py").is_file()
        and not (ROOT / m.replace(".", "/") / "__main__.py").is_file()
    ]
    assert not missing, f"{page.relative_to(ROOT)} runs modules that do not exist: {missing}"
