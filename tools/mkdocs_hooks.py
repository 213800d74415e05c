"""MkDocs hooks of the documentation site (``mkdocs.yml`` loads this file by path).

They let the docstrings stay reStructuredText-flavoured plain text, readable in ``help()``, and
still render as a site; everything happens at build time, so the built site needs no
JavaScript from elsewhere and opens from a local build:

- Sphinx roles (``:class:`~quotientgeo.GLQuotient```, ``:meth:`ParameterGeometry.add```)
  become cross-references into the API reference (mkdocs-autorefs). A role naming a public
  object resolves to its canonical path; one naming quotientgeo's API with a name it does not
  have fails ``mkdocs build --strict``. Roles naming other libraries (torch, geoopt, …),
  private objects, modules, or a bare member of the documented class stay code.
- reST simple tables become Markdown tables, and a paragraph's closing ``::`` (reST's marker of
  the literal block that follows) a colon.
- Math, written as reST's ``:math:`...``` role or as ``$...$``, ``$$...$$``, is converted to
  MathML, which browsers render natively (``pymdownx.arithmatex`` marks it, this hook converts
  it); TeX that does not convert fails the strict build.
"""

from __future__ import annotations

import html
import itertools
import logging
import re

from latex2mathml.converter import convert as latex_to_mathml
from markdown import Extension
from markdown.preprocessors import Preprocessor
from mkdocs.plugins import event_priority

log = logging.getLogger("mkdocs.hooks.quotientgeo")

# :role:`target` and :role:`~dotted.target`
ROLE = re.compile(r":(class|meth|func|attr|mod|data|obj|exc):`(~?)([^`<>]+)`")
# references into these libraries are shown as code: the site has no inventory of theirs
EXTERNAL = ("torch", "geoopt", "scipy", "numpy", "json", "math", "typing", "collections")
MATH_ROLE = re.compile(r":math:`([^`]+)`")
FENCE = re.compile(r"^\s*(```|~~~)")


def _public_objects() -> dict[str, object]:
    import quotientgeo
    import quotientgeo.curvature
    import quotientgeo.geometry
    import quotientgeo.manifolds
    import quotientgeo.optim
    import quotientgeo.options
    import quotientgeo.sharpness
    import quotientgeo.testing

    modules = (quotientgeo, quotientgeo.geometry, quotientgeo.manifolds, quotientgeo.optim)
    public = {}
    for module in (
        *modules,
        quotientgeo.options,
        quotientgeo.sharpness,
        quotientgeo.testing,
        quotientgeo.curvature,
    ):
        public.update({name: getattr(module, name) for name in module.__all__})
    # the optional integration (transformers comes with the test extra): without it, references
    # to its names fail the strict build
    try:
        import quotientgeo.integrations.transformers as hf
    except ImportError:
        return public
    public.update({name: getattr(hf, name) for name in hf.__all__})
    return public


def _resolve(target: str, public: dict[str, object]) -> str | None:
    """The canonical dotted path of a reference to quotientgeo's public API, or None.

    ``GLQuotient.at``, ``quotientgeo.GLQuotient.at`` and ``quotientgeo.manifolds.GLQuotient.at``
    all give ``quotientgeo.manifolds.gl.base.GLQuotient.at``, the path under which
    mkdocstrings registers the documented object besides the path of the page's directive.
    """
    parts = target.split(".")
    if parts[0] == "quotientgeo":  # the first public class or function on the path starts it
        starts = [i for i, part in enumerate(parts) if hasattr(public.get(part), "__qualname__")]
        if not starts:
            return None
        parts = parts[starts[0] :]
    obj = public.get(parts[0])
    qualname = getattr(obj, "__qualname__", None)
    if qualname is None:
        return None
    member = obj
    for part in parts[1:]:
        if not hasattr(member, part):
            return None
        member = getattr(member, part)
    return ".".join([obj.__module__, qualname, *parts[1:]])


def _role_to_markdown(match: re.Match[str], public: dict[str, object]) -> str:
    role, short, target = match.group(1), match.group(2), match.group(3).strip()
    title = target.rsplit(".", 1)[-1] if short else target.lstrip(".")
    private = any(part.startswith("_") for part in target.split(".") if part)
    if role == "mod" or target.startswith(".") or private or target.split(".")[0] in EXTERNAL:
        return f"`{title}`"
    identifier = _resolve(target, public)
    if identifier is None:
        if "." not in target and not target[:1].isupper():
            return f"`{title}`"  # a member named from its own class: no scope here
        log.warning("reference to %r, which quotientgeo's public API does not have", target)
        return f"`{title}`"
    return f"[`{title}`][{identifier}]"


RST_BORDER = re.compile(r"^(\s*)(=+)((?:\s+=+)+)\s*$")


def _rst_tables(lines: list[str]) -> list[str]:
    """reStructuredText simple tables (``===  ===`` borders) as Markdown pipe tables."""
    out, i = [], 0
    while i < len(lines):
        border = RST_BORDER.match(lines[i])
        end = i + 1
        while border and end < len(lines) and lines[end].strip():
            end += 1  # the table runs to the next blank line; its last line is a border
        if not border or end - i < 4 or not RST_BORDER.match(lines[end - 1]):
            out.append(lines[i])
            i += 1
            continue
        spans = [m.span() for m in re.finditer(r"=+", lines[i])]
        starts = [a for a, _ in spans] + [None]

        def cells(line: str, starts=starts) -> list[str]:
            return [line[a:b].strip() for a, b in itertools.pairwise(starts)]

        rows = [cells(line) for line in lines[i + 1 : end - 1] if not RST_BORDER.match(line)]
        indent = border.group(1)
        out.append(indent + "| " + " | ".join(rows[0]) + " |")
        out.append(indent + "|" + "---|" * len(rows[0]))
        out.extend(indent + "| " + " | ".join(row) + " |" for row in rows[1:])
        i = end
    return out


class _Roles(Preprocessor):
    public: dict[str, object] | None = None

    def run(self, lines: list[str]) -> list[str]:
        if _Roles.public is None:
            _Roles.public = _public_objects()
        public = _Roles.public
        out, fenced = [], False
        for line in lines:
            if FENCE.match(line):
                fenced = not fenced
            if not fenced:
                if line.endswith("::") and line.strip() != "::":
                    line = line[:-1]  # reST's "paragraph::" before a literal block
                line = MATH_ROLE.sub(lambda m: f"${m.group(1).strip()}$", line)
                line = ROLE.sub(lambda m: _role_to_markdown(m, public), line)
            out.append(line)
        return _rst_tables(out)


class _RolesExtension(Extension):
    def extendMarkdown(self, md):
        md.preprocessors.register(_Roles(md), "quotientgeo_roles", 40)


@event_priority(100)  # before mkdocstrings reads the extensions
def on_config(config):
    config.markdown_extensions.append(_RolesExtension())
    return config


MATH = re.compile(
    r'<(span|div) class="arithmatex">(.*?)</\1>',
    re.DOTALL,
)
DELIMITERS = {"\\(": "\\)", "\\[": "\\]", "$$": "$$", "$": "$"}


def _math_to_mathml(match: re.Match[str], page) -> str:
    tag, body = match.group(1), html.unescape(match.group(2)).strip()
    for left, right in DELIMITERS.items():
        if body.startswith(left) and body.endswith(right):
            body = body[len(left) : len(body) - len(right)]
            break
    try:
        mathml = latex_to_mathml(body, display="block" if tag == "div" else "inline")
    except Exception as error:  # latex2mathml raises its own exception types
        log.warning("%s: math that does not convert: %r (%s)", page.file.src_uri, body, error)
        return match.group(0)
    return f'<{tag} class="arithmatex">{mathml}</{tag}>'


def on_page_content(html_text: str, page, **kwargs) -> str:
    return MATH.sub(lambda m: _math_to_mathml(m, page), html_text)
