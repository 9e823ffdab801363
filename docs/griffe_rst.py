"""A griffe extension for hvdkit's docs site (mkdocs.yml): hvdkit's and Horovod's docstrings
are written for Sphinx, the site renders Markdown. Sphinx roles (``:func:`setup```) become code
spans, and a paragraph's closing ``::`` (Sphinx's "a literal block follows") a plain colon, so
the indented block after it renders as code, as Markdown reads indentation."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj|py:\w+):`~?\.?([^`]+)`")
LITERAL = re.compile(r"(\S)::$", re.MULTILINE)
DOUBLE_BACKTICKS = re.compile(r"``([^`]+)``")


def markdown(text: str) -> str:
    """A Sphinx docstring's text with its roles, ``::`` and double backticks as Markdown."""
    text = ROLE.sub(r"`\1`", text)
    text = LITERAL.sub(r"\1:", text)
    return DOUBLE_BACKTICKS.sub(r"`\1`", text)


class SphinxToMarkdown(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
