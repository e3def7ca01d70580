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
