"""Sphinx configuration for the lightning-bagua documentation."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))
# The local extension (build-time tables and charts), and the benchmarks' lab whose traffic model it evaluates.
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))

from lightning_bagua.__about__ import __version__  # noqa: E402

project = "lightning-bagua"
author = "lightning-bagua developers"
copyright = "lightning-bagua developers"
release = __version__
version = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
    # MathJax served from the site itself, so the formulas render offline too (a CI artifact, a laptop).
    "sphinx-mathjax-offline",
    "sphinx_autodoc_typehints",
    "myst_parser",
    "lb_docs",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "_ext"]
templates_path: list[str] = []

# Markdown pages: $...$ math, ::: fences, and anchors for headings so pages can link to sections.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_typehints = "description"
typehints_use_signature = False
typehints_use_signature_return = False
always_document_param_types = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
nitpicky = False

# No inventories are fetched (the build must work without network access); cross-references to torch and
# Lightning stay plain text.
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}

html_theme = "furo"
html_title = f"lightning-bagua {__version__}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    "source_repository": "https://github.com/Lightning-Universe/lightning-Bagua",
    "source_branch": "main",
    "source_directory": "docs/source/",
}
pygments_style = "friendly"
