"""The documentation: its code blocks run, its API reference covers the public API, the README's
links resolve, and the changelog has a section for the current version.

The site itself (links, anchors, cross-references of the docstrings) is checked by
``mkdocs build --strict`` in CI.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import quotientgeo

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in DOCS.glob("*.md"))]

# A ```python block runs unless the line before its fence is such a comment, with the reason:
# <!-- docs-test: skip (needs the results of quotientgeo reproduce transformers) -->
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((.+)\)\s*-->")
FENCE = re.compile(r"^```python\s*$")


def code_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason or None)`` of every ```python block of a Markdown page."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            start = i + 1
            end = next(j for j in range(start, len(lines)) if lines[j].startswith("```"))
            before = lines[i - 1] if i else ""
            skip = SKIP.search(before)
            blocks.append((start + 1, "\n".join(lines[start:end]), skip and skip.group(1)))
            i = end
        i += 1
    return blocks


def test_code_blocks_are_found():
    text = "a\n```python\nx = 1\n```\n<!-- docs-test: skip (no) -->\n```python\ny\n```\n"
    assert code_blocks(text) == [(3, "x = 1", None), (7, "y", "no")]


@pytest.mark.parametrize("page", PAGES)
def test_code_blocks_run(page, tmp_path, monkeypatch):
    """The page's blocks run in order in one namespace (later blocks continue earlier ones)."""
    blocks = code_blocks((ROOT / page).read_text(encoding="utf-8"))
    runnable = [(line, code) for line, code, skip in blocks if skip is None]
    if not runnable:
        pytest.skip(f"{page} has no runnable Python block")
    monkeypatch.chdir(tmp_path)  # files a block writes land here
    namespace: dict = {"__name__": "__docs__"}
    for line, code in runnable:
        exec(compile(code, f"{page}:{line}", "exec"), namespace)


def public_names() -> set[str]:
    import quotientgeo.curvature
    import quotientgeo.geometry
    import quotientgeo.integrations.transformers
    import quotientgeo.manifolds
    import quotientgeo.optim
    import quotientgeo.testing

    names = {f"quotientgeo.{n}" for n in quotientgeo.__all__ if n not in ("optim", "__version__")}
    for module in (
        quotientgeo.curvature,
        quotientgeo.geometry,
        quotientgeo.integrations.transformers,
        quotientgeo.manifolds,
        quotientgeo.optim,
        quotientgeo.testing,
    ):
        for name in module.__all__:
            # a name also exported by quotientgeo is documented once, under quotientgeo
            if name not in quotientgeo.__all__:
                names.add(f"{module.__name__}.{name}")
    return names


def documented_names() -> set[str]:
    directive = re.compile(r"^::: (\S+)\s*$", re.MULTILINE)
    return {
        name
        for page in (DOCS / "api").glob("*.md")
        for name in directive.findall(page.read_text(encoding="utf-8"))
    }


def test_api_reference_documents_every_public_name():
    missing = public_names() - documented_names()
    assert not missing, f"public names without an entry in docs/api/: {sorted(missing)}"


def test_api_reference_documents_only_names_that_exist():
    import importlib

    for name in documented_names():
        module_name, _, attribute = name.rpartition(".")
        try:
            module = importlib.import_module(name)
        except ImportError:
            module = importlib.import_module(module_name)
            assert hasattr(module, attribute), f"docs/api names {name}, which does not exist"


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links {target}, which does not exist"


def test_changelog_has_a_section_for_this_version():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    sections = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
    assert sections[0] == "Unreleased", "CHANGELOG.md starts with an [Unreleased] section"
    assert quotientgeo.__version__ in sections, (
        f"CHANGELOG.md has no section for version {quotientgeo.__version__}"
    )
