"""Hooks of the documentation site (mkdocs.yml `hooks:`; `make docs`).

The notebooks live in notebooks/, outside docs/: they are added to the site's files as
notebooks/NAME.ipynb (before mkdocs-jupyter turns them into pages, with their stored
outputs: execute: false), so a notebook added there is a page of the site (and mkdocs'
strict build fails until mkdocs.yml's nav lists it). BENCHMARKS.md (the repository's
table of today's numbers, which the docs link) is carried the same way.

Links between these files are written as paths in the repository (docs/api.md ->
../BENCHMARKS.md, BENCHMARKS.md -> docs/benchmarks/diary.md): they are pointed at the
pages of the site. A link to a file outside the repository (../shared/docs/hooks.md, the
project's shared checkout beside it, which no page of the site can hold) becomes text
naming the path, as README.md writes it. Any other link that leaves docs/ is left alone,
for mkdocs to report (and --strict to fail on).

Docstrings: the package's docstrings write indices and shapes as plain text
(``map[t][m, n]``, ``R[l, t] [N, N]``), which Markdown reads as reference links and
mkdocstrings then as cross-references to nothing. ``IndexBrackets`` (a griffe
extension, named in mkdocs.yml's mkdocstrings options) escapes a ``[`` that follows
``]`` outside code, so that they show as written.
"""

from __future__ import annotations

import os
import posixpath
import re

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# files of the repository outside docs/ that the site carries, by their path in the repository
CARRIED = ["BENCHMARKS.md"] + sorted(
    "notebooks/" + n for n in os.listdir(os.path.join(ROOT, "notebooks")) if n.endswith(".ipynb")
)
_LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")  # [text](target#anchor)
_OUTSIDE = re.compile(r"(?<!!)\[([^\]]+)\]\((\.\./[^)\s]+)\)")  # [text](../...): checked for leaving the repo
_REF = re.compile(r"^( {0,3}\[[^\]]+\]:[ \t]*)([^\s#]+)(#\S*)?()", re.M)  # [label]: target#anchor


@event_priority(100)  # before mkdocs-jupyter's on_files, which converts the .ipynb files
def on_files(files, config):
    for path in CARRIED:
        files.append(
            File(path, src_dir=ROOT, dest_dir=config["site_dir"], use_directory_urls=config["use_directory_urls"])
        )
    return files


def _site_uri(repo_path: str):
    """Where a file of the repository is in the site (None: not in it)."""
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/") :]
    return repo_path if repo_path in CARRIED else None


def on_page_markdown(markdown, page, config, files):
    """A relative link that leaves the page's directory for a file the site carries
    (a page of docs/ to BENCHMARKS.md or a notebook, BENCHMARKS.md to docs/...) -> a link
    to that page of the site."""
    if page.file.abs_src_path is None:
        return markdown
    here = os.path.dirname(os.path.abspath(page.file.abs_src_path))
    page_dir = posixpath.dirname(page.file.src_uri) or "."

    def fix(m):
        target = m.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return m.group(0)
        repo_path = os.path.relpath(os.path.normpath(os.path.join(here, target)), ROOT).replace(os.sep, "/")
        uri = _site_uri(repo_path)
        if uri is None:
            return m.group(0)  # mkdocs reports it (a file the site does not carry)
        return m.group(1) + posixpath.relpath(uri, page_dir) + (m.group(3) or "") + m.group(4)

    def outside(m):
        repo_path = os.path.relpath(os.path.normpath(os.path.join(here, m.group(2))), ROOT).replace(os.sep, "/")
        if not repo_path.startswith("../") or "://" in m.group(2):
            return m.group(0)
        return "%s (`%s`, beside the repository)" % (m.group(1), repo_path)

    return _REF.sub(fix, _LINK.sub(fix, _OUTSIDE.sub(outside, markdown)))


# ---------------------------------------------------------------- docstrings

_CODE_SPAN = re.compile(r"(`+).*?\1")
_INDEX_AFTER_INDEX = re.compile(r"\]([ \t]?)\[")


def escape_index_brackets(text: str) -> str:
    r"""``a[t][m, n]`` -> ``a[t]\[m, n]`` (and ``] [``) outside code spans, fenced blocks,
    indented code blocks and doctest lines, so that Markdown shows it as text, not as a link."""
    out, fence, code, blank = [], None, False, True
    for line in text.split("\n"):
        stripped = line.lstrip()
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            out.append(line)
            continue
        if stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            out.append(line)
            continue
        # an indented line is code after a blank line (or more code); after text it continues the paragraph
        code = bool(stripped) and line.startswith(("    ", "\t")) and (blank or code)
        blank = not stripped
        if code or stripped.startswith(">>>"):
            out.append(line)
            continue
        parts, last = [], 0
        for m in _CODE_SPAN.finditer(line):
            parts.append(_INDEX_AFTER_INDEX.sub(r"]\1\\[", line[last : m.start()]))
            parts.append(m.group(0))
            last = m.end()
        parts.append(_INDEX_AFTER_INDEX.sub(r"]\1\\[", line[last:]))
        out.append("".join(parts))
    return "\n".join(out)


try:
    import griffe
except ImportError:  # the docs extra is not installed: the hooks above still load
    griffe = None

if griffe is not None:

    class IndexBrackets(griffe.Extension):
        """Escapes index brackets in every docstring (see the module's docstring)."""

        def on_instance(self, *, obj, **kwargs) -> None:
            if obj.docstring is not None:
                obj.docstring.value = escape_index_brackets(obj.docstring.value)
