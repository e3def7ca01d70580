"""Sphinx configuration: MyST pages and the API reference from docstrings."""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "jax-flash"
author = "the jax-flash authors"
copyright = "the jax-flash authors, Apache-2.0"
release = "0.2.0"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
master_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "none"
napoleon_google_docstring = True
html_theme = "alabaster"
html_static_path = ["_static"]
