"""Escaping of text that comes from runs (sweep, variant and model names, failure messages, file
names) into the formats the report writes: one helper per format.

Names of runs are user input (``sweep.name=…``, a snapshot CSV edited by hand, an exception's
text): written raw, ``<img src=x onerror=…>`` becomes HTML in a rendered REPORT.md and ``$`` or
``}`` breaks a LaTeX table. Generated text (our own numbers and prose) is not escaped, so each
helper is applied where run text enters a document, and only there.
"""
from __future__ import annotations

import html as _html
import re

# Markdown punctuation that starts emphasis, code, math or strikethrough, or ends a table cell;
# escaped with a backslash (CommonMark: any ASCII punctuation may be).
_MD_PUNCT = set("\\`*$~|")
# A bracket is a link only as `[text](url)` or `[text][ref]`: the `]` before `(` or `[` is escaped,
# so an interval "[0.1, 0.2]" stays as written.
_LINK = re.compile(r"\](?=[(\[])")
# An underscore inside a word (study_cpu, no_key_norm) is literal in CommonMark and GFM; one at a
# word's edge can open or close emphasis.
_EDGE_UNDERSCORE = re.compile(r"(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")


def html(text) -> str:
    """Text for HTML: ``& < > " '`` as entities."""
    return _html.escape(str(text), quote=True)


def md(text) -> str:
    """Text for Markdown prose or a table cell, rendered literally: HTML as entities, Markdown's
    active punctuation backslash-escaped, a leading ``#`` (a heading at a line's start) escaped."""
    out = []
    for ch in _html.escape(str(text), quote=False):
        out.append("\\" + ch if ch in _MD_PUNCT else ch)
    s = _LINK.sub(r"\\]", _EDGE_UNDERSCORE.sub(r"\\_", "".join(out)))
    return "\\" + s if s.startswith("#") else s


def md_cell(text) -> str:
    """`md`, on one line (a line break or run of blanks inside a cell would end the table row)."""
    return md(" ".join(str(text).split()))


# pdflatex (no unicode-math) refuses these characters in text: each as LaTeX's own.
_TEX = {"\\": r"\textbackslash{}", "{": r"\{", "}": r"\}", "$": r"\$", "&": r"\&", "%": r"\%",
        "#": r"\#", "_": r"\_", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
        "<": r"\textless{}", ">": r"\textgreater{}",
        "±": r"$\pm$", "Δ": r"$\Delta$", "τ": r"$\tau$", "α": r"$\alpha$", "σ": r"$\sigma$",
        "√": r"$\surd$", "·": r"$\cdot$", "≤": r"$\le$", "≥": r"$\ge$", "≈": r"$\approx$",
        "−": "-", "–": "--", "—": "---"}


def latex(text) -> str:
    """Text for a LaTeX document (a table cell or caption), printed literally: every special
    character escaped in one pass, so an escape is never escaped again."""
    return "".join(_TEX.get(ch, ch) for ch in str(text))
