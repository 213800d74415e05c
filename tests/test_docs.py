"""The documentation: each of its code blocks runs on its own, the examples run, its API
reference covers the public API, the README's links resolve, every page is in the site's
navigation and in the README's list, and the changelog has a section for the current version.

The site itself (links, anchors, cross-references of the docstrings) is checked by
``mkdocs build --strict`` in CI.
"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import quotientgeo

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in DOCS.glob("*.md"))]
EXAMPLES = sorted(ROOT.glob("examples/*.py"))

# A ```python block runs unless the line before its fence is such a comment, with the reason:
# <!-- docs-test: skip (needs the results of quotientgeo reproduce transformers) -->
# A skipped block is still compiled and checked for undefined names and unused imports.
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((.+)\)\s*-->")
FENCE = re.compile(r"^```python\s*$")
# a line of a block that includes a file (pymdownx.snippets), path relative to the repository
SNIPPET = re.compile(r'^--8<--\s+"([^"]+)"\s*$')
TORCHRUN = re.compile(r"^# \S+\.py — run with: torchrun ")

# examples that no test runs, with the reason (each is still compiled and linted)
EXAMPLES_NOT_RUN = {
    "llama_1b_sharpness.py": "a 1.1B-parameter model: 10 GiB and a minute and a half",
}
# examples that a test elsewhere runs
EXAMPLES_RUN_ELSEWHERE = {"define_a_symmetry.py": "tests/manifolds/test_user_subclasses.py"}
# examples run on smaller sizes than their command's (the command's take half a minute)
EXAMPLE_ARGUMENTS = {"llama_fd_step.py": ["--width", "32", "--layers", "1"]}


def code_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason or None)`` of every ```python block of a Markdown page, with
    each included file (``--8<-- "path"``) in place of its line."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            start = i + 1
            end = next(j for j in range(start, len(lines)) if lines[j].startswith("```"))
            before = lines[i - 1] if i else ""
            skip = SKIP.search(before)
            code = "\n".join(included(line) for line in lines[start:end])
            blocks.append((start + 1, code, skip and skip.group(1)))
            i = end
        i += 1
    return blocks


def included(line: str) -> str:
    match = SNIPPET.match(line)
    return (ROOT / match.group(1)).read_text(encoding="utf-8").rstrip("\n") if match else line


def all_blocks() -> list[tuple[str, int, str, str | None]]:
    return [
        (page, line, code, skip)
        for page in PAGES
        for line, code, skip in code_blocks((ROOT / page).read_text(encoding="utf-8"))
    ]


BLOCKS = all_blocks()
RUNNABLE = [
    pytest.param(f"{page}:{line}", code, id=f"{page}:{line}")
    for page, line, code, skip in BLOCKS
    if not skip
]
INCLUDED = {  # examples a page includes whole: they run as its block
    m.group(1)
    for page in PAGES
    for m in re.finditer(r'^--8<--\s+"(examples/[^"]+)"', (ROOT / page).read_text(), re.M)
}


def test_code_blocks_are_found():
    text = "a\n```python\nx = 1\n```\n<!-- docs-test: skip (no) -->\n```python\ny\n```\n"
    assert code_blocks(text) == [(3, "x = 1", None), (7, "y", "no")]
    text = '```python\n--8<-- "examples/quickstart.py"\n```\n'
    [(_, code, _)] = code_blocks(text)
    assert code == (ROOT / "examples/quickstart.py").read_text().rstrip("\n")


@pytest.mark.parametrize(("where", "code"), RUNNABLE)
def test_code_block_runs_on_its_own(where, code, tmp_path, monkeypatch):
    """Each block runs in a fresh namespace, in a fresh folder (files it writes land there); a
    script for ``torchrun`` (its first line ``# NAME.py — run with: torchrun ...``) runs under
    ``torchrun --standalone --nproc_per_node 2`` on the CPU."""
    monkeypatch.chdir(tmp_path)
    if TORCHRUN.match(code):
        (tmp_path / "script.py").write_text(code, encoding="utf-8")
        path = os.pathsep.join(p for p in sys.path if p)  # what this process imports
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        done = subprocess.run([*torchrun, "--nproc_per_node", "2", "script.py"], text=True,
                              env={**os.environ, "PYTHONPATH": path}, capture_output=True,
                              timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return
    exec(compile(code, where, "exec"), {"__name__": "__docs__"})


def test_code_blocks_compile_and_name_nothing_undefined(tmp_path):
    """Every block, skipped or not, compiles and passes pyflakes' checks (ruff's ``F`` rules:
    an undefined name, an unused import), so a block that cannot run in a test still reads
    right on its own."""
    pytest.importorskip("ruff")
    for page, line, code, _ in BLOCKS:
        compile(code, f"{page}:{line}", "exec")
        name = f"{page.replace('/', '__').removesuffix('.md')}__line{line}.py"
        (tmp_path / name).write_text(code + "\n", encoding="utf-8")
    ruff = [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F"]
    done = subprocess.run([*ruff, "--output-format", "concise", "."], cwd=tmp_path, text=True,
                          capture_output=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_skipped_block_says_why():
    for page, line, _, skip in BLOCKS:
        assert skip is None or len(skip.split()) >= 3, f"{page}:{line}: skipped for {skip!r}"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(example, tmp_path, monkeypatch):
    """Every example runs as its command would (``python examples/NAME.py``, with the arguments
    of ``EXAMPLE_ARGUMENTS``, here in this process, as ``__main__``, in a fresh folder), unless it
    is run elsewhere: by a test named in ``EXAMPLES_RUN_ELSEWHERE``, or as a docs block."""
    compile(example.read_text(encoding="utf-8"), str(example), "exec")
    name = example.name
    if f"examples/{name}" in INCLUDED:
        pytest.skip("a docs page includes it: test_code_block_runs_on_its_own runs it")
    if name in EXAMPLES_RUN_ELSEWHERE:
        assert name in (ROOT / EXAMPLES_RUN_ELSEWHERE[name]).read_text()
        pytest.skip(f"run by {EXAMPLES_RUN_ELSEWHERE[name]}")
    if name in EXAMPLES_NOT_RUN:
        pytest.skip(EXAMPLES_NOT_RUN[name])
    if "quotientgeo_studies" in example.read_text(encoding="utf-8"):
        pytest.importorskip("quotientgeo_studies")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setattr(sys, "argv", [str(example), *EXAMPLE_ARGUMENTS.get(name, [])])
    runpy.run_path(str(example), run_name="__main__")


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


def test_every_page_is_in_the_navigation_the_readme_and_the_home_page():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    home = (DOCS / "index.md").read_text(encoding="utf-8")
    for page in sorted(DOCS.glob("*.md")):
        assert re.search(rf":\s*{re.escape(page.name)}\s*$", nav, re.M), f"mkdocs.yml: {page.name}"
        if page.name not in ("index.md", "changelog.md"):  # the README links CHANGELOG.md
            assert f"](docs/{page.name}" in readme, f"README.md does not link {page.name}"
            assert f"]({page.name}" in home, f"docs/index.md does not link {page.name}"


def test_changelog_has_a_section_for_this_version():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    sections = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
    assert sections[0] == "Unreleased", "CHANGELOG.md starts with an [Unreleased] section"
    assert quotientgeo.__version__ in sections, (
        f"CHANGELOG.md has no section for version {quotientgeo.__version__}"
    )
