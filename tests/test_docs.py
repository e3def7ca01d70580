"""The code of the README and the guides runs: each page's ```python
blocks, in order, in one namespace (on the CPU, in seconds)."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def _blocks(path):
  return re.findall(r"^```python\n(.*?)^```", path.read_text(),
                    flags=re.M | re.S)


@pytest.mark.parametrize("path", [p for p in PAGES if _blocks(p)],
                         ids=lambda p: p.name)
def test_page_code_runs(path):
  namespace = {"__name__": f"docs_{path.stem}"}
  for i, code in enumerate(_blocks(path)):
    exec(compile(code, f"{path.name}, block {i + 1}", "exec"), namespace)


@pytest.mark.parametrize("name", ["pinned", "newest"])
def test_install_docs_state_the_versions_tested(name):
  """README and the install guide name each tested jax version with the
  constraints file it comes from, and pyproject's range admits it."""
  from packaging.specifiers import SpecifierSet
  text = (ROOT / "requirements" / f"{name}.txt").read_text()
  version = re.search(r"^jax==(\S+)$", text, re.M).group(1)
  assert re.search(rf"^jaxlib=={re.escape(version)}$", text, re.M)
  for page in (ROOT / "README.md", ROOT / "docs" / "getting_started.md"):
    stated = " ".join(page.read_text().split())
    assert f"jax {version} (`requirements/{name}.txt`" in stated, page.name
  project = (ROOT / "pyproject.toml").read_text()
  declared = re.search(r'"jax(>=[^"]+)"', project).group(1)
  assert version in SpecifierSet(declared)
