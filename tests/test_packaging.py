"""The installed package's metadata: one version, the supported Python and torch versions
stated consistently, spanning exactly the versions CI tests (``.ci/matrix``) and containing the
ones this test runs on, project URLs, ``py.typed``.

These read the metadata of the installed distribution (what ``pip show`` and package indexes
show), so they test an installed quotientgeo; run from a source tree without installing it,
they skip.
"""

from __future__ import annotations

import os
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import quotientgeo

ROOT = Path(__file__).resolve().parents[1]

try:
    META = metadata.metadata("quotientgeo")
except metadata.PackageNotFoundError:  # pragma: no cover - a source tree on sys.path only
    pytest.skip("quotientgeo is not installed", allow_module_level=True)


def classifier_pythons() -> list[Version]:
    """The ``Programming Language :: Python :: 3.x`` classifiers, sorted."""
    prefix = "Programming Language :: Python :: "
    found = [c.removeprefix(prefix) for c in META.get_all("Classifier") or []]
    return sorted(Version(v) for v in found if re.fullmatch(r"3\.\d+", v))


def torch_requirement() -> Requirement:
    requirements = [Requirement(r) for r in META.get_all("Requires-Dist") or []]
    return next(r for r in requirements if r.name == "torch" and r.marker is None)


def test_one_version():
    assert META["Version"] == quotientgeo.__version__


def test_python_versions_stated_consistently():
    requires = SpecifierSet(META["Requires-Python"])
    pythons = classifier_pythons()
    assert pythons, "no 'Programming Language :: Python :: 3.x' classifiers"
    # the classifiers are consecutive minor versions starting at the requires-python floor
    assert all(str(v) in requires for v in pythons)
    floor = Version(f"3.{pythons[0].minor - 1}")
    assert str(floor) not in requires, f"requires-python admits {floor}, not in the classifiers"
    minors = [v.minor for v in pythons]
    assert minors == list(range(minors[0], minors[-1] + 1))


def matrix() -> dict[str, tuple[Version, Version]]:
    """The legs of CI (``.ci/matrix``): name -> (Python minor version, torch release)."""
    legs = {}
    for line in (ROOT / ".ci" / "matrix").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, python, torch_release = line.split()
            legs[name] = (Version(python), Version(torch_release))
    return legs


def minor(version: Version) -> tuple[int, int]:
    return version.release[0], version.release[1]


def test_running_python_is_supported():
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert running in SpecifierSet(META["Requires-Python"])
    assert Version(running) in classifier_pythons(), f"Python {running} is not a classifier"


def test_running_torch_is_supported():
    requirement = torch_requirement()
    running = Version(torch.__version__).base_version  # without a local build tag (+cpu)
    assert requirement.specifier.contains(running), (
        f"torch {torch.__version__} is outside the stated requirement {requirement}"
    )


def test_the_declared_versions_are_the_ends_ci_tests():
    """The oldest Python and torch the metadata admits are those of CI's oldest leg, the newest
    Python classifier is that of the leg with the newest torch, and every leg is admitted: a
    claim beyond what CI tests fails here."""
    legs = matrix()
    pythons = classifier_pythons()
    oldest = min(legs.values(), key=lambda leg: leg[1])
    newest = max(legs.values(), key=lambda leg: leg[1])
    assert oldest[0] == pythons[0] == min(p for p, _ in legs.values()), "oldest Python"
    assert newest[0] == pythons[-1] == max(p for p, _ in legs.values()), "newest Python"
    floor = Version(torch_floor())
    assert minor(floor) == minor(oldest[1]), f"torch>={floor} is claimed, {oldest[1]} tested"
    for name, (python, release) in legs.items():
        assert str(python) in SpecifierSet(META["Requires-Python"]), name
        assert torch_requirement().specifier.contains(str(release)), name


def test_ci_runs_the_versions_of_its_leg():
    """In CI (``.ci/run`` names the leg), the running Python and torch are the leg's."""
    leg = os.environ.get("QUOTIENTGEO_CI_LEG")
    if leg is None:
        pytest.skip("not a CI leg (QUOTIENTGEO_CI_LEG unset)")
    python, release = matrix()[leg]
    assert sys.version_info[:2] == minor(python), (leg, sys.version)
    assert Version(Version(torch.__version__).base_version) == release, (leg, torch.__version__)


def torch_floor() -> str:
    floor = re.search(r">=\s*([\d.]+)", str(torch_requirement().specifier))
    assert floor is not None, "torch has no lower bound"
    return floor.group(1)


def release_name(version: Version) -> str:
    return ".".join(map(str, minor(version)))


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_docs_state_the_supported_versions(page):
    """The README and the site's home page say what the metadata says, and name each leg."""
    text = " ".join((ROOT / page).read_text(encoding="utf-8").split())
    pythons = classifier_pythons()
    releases = sorted(release for _, release in matrix().values())
    assert (
        f"tested on Python {pythons[0]} to {pythons[-1]} with PyTorch {torch_floor()} to "
        f"{release_name(releases[-1])}" in text
    )
    for python, release in matrix().values():
        assert f"Python {python} with torch {release}" in text, (python, release)


def test_project_urls():
    urls = dict(u.split(", ", 1) for u in META.get_all("Project-URL") or [])
    assert {"Documentation", "Changelog"} <= set(urls)
    mkdocs = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    site_url = re.search(r"^site_url:\s*(\S+)", mkdocs, re.MULTILINE)
    assert site_url is not None and urls["Documentation"] == site_url.group(1)
    assert urls["Changelog"].endswith("/CHANGELOG.md")


def test_typed():
    assert "Typing :: Typed" in (META.get_all("Classifier") or [])
    assert (Path(quotientgeo.__file__).parent / "py.typed").is_file()


_IMPORT_PROBE = """
import warnings
import numpy, torch  # they add filters of their own on import
before = list(warnings.filters)
import quotientgeo, quotientgeo.optim, quotientgeo.cli
assert warnings.filters == before, "importing quotientgeo changed the warning filters"
warnings.warn("`torch.jit.script` is deprecated. Please switch", FutureWarning)
"""


def test_import_is_quiet_and_silences_only_geoopts_jit_warning():
    """A fresh interpreter with every warning shown prints none on ``import quotientgeo``
    (geoopt's ``torch.jit.script`` deprecation is silenced while geoopt is imported); quotientgeo's
    import leaves the filters as they were, so the same warning raised afterwards is still shown."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-W", "default", "-c", _IMPORT_PROBE],
        capture_output=True,
        text=True,
        check=True,
    )
    # one "file:line: Category: message" line a warning (Python 3.13 also prints the source
    # line of code given with -c, which is no warning of its own)
    lines = [line for line in done.stderr.splitlines() if re.match(r"\S+:\d+: \w+: ", line)]
    assert len(lines) == 1 and lines[0].startswith("<string>:"), done.stderr


def test_the_library_holds_no_study_code():
    """The studies and the developer benchmarks are a distribution of their own (studies/): the
    installed library lists none of their files, and no module of it imports them."""
    files = [str(f) for f in metadata.files("quotientgeo") or []]
    prefixes = ("quotientgeo/experiments/", "quotientgeo_studies/")
    assert not [f for f in files if f.startswith(prefixes)]
    package = Path(quotientgeo.__file__).parent
    assert not (package / "experiments").exists()
    importing = [
        p.relative_to(package)
        for p in package.rglob("*.py")
        if re.search(r"^\s*(from|import)\s+quotientgeo_studies\b", p.read_text(), re.M)
    ]
    assert not importing
