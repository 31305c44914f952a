"""Write docs/modules.md, the module inventory, from the code: each package's and module's docstring, first sentence.

    python scripts/module_map.py            # rewrite docs/modules.md
    python scripts/module_map.py --check    # exit 1 when docs/modules.md is not what the code says

Packages are listed in the order of the layers contract in pyproject.toml (top to bottom), so the inventory reads
like docs/architecture.md's map. tests/unit/test_docs_true.py runs the check.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "preheat"
OUT = ROOT / "docs" / "modules.md"
LIMIT = 220
HEADER = """# Modules

The inventory of `src/preheat`, generated from each module's docstring by `python scripts/module_map.py` (a test
fails when this page and the code disagree). Packages are in layer order, top to bottom: docs/architecture.md.
"""


def layer_order() -> list[str]:
    """The top-level units named in the layers contract, top layer first."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    return [name for row in layers for name in re.split(r"\s*[|:]\s*", row)]


def summary(path: Path) -> str:
    """The first sentence of ``path``'s docstring, on one line; a module without a docstring fails the check."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.split("\n\n", 1)[0].split())
    if not text:
        raise SystemExit(f"{path.relative_to(ROOT)} has no docstring: say in one sentence what the module is for")
    match = re.match(r"(.+?\.)(\s|$)", text)
    sentence = (match[1] if match else text).replace("``", "`").replace("|", "\\|")
    if len(sentence) > LIMIT:  # a long first sentence is cut at a word: the module's docstring has the rest
        sentence = sentence[:LIMIT].rsplit(" ", 1)[0] + " …"
    return sentence


def render() -> str:
    lines = [HEADER]
    top = [p for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    order = {name: i for i, name in enumerate(layer_order())}
    for package in sorted(top, key=lambda p: (order.get(p.name, len(order)), p.name)):
        lines += [f"## `{package.name}/`", "", summary(package / "__init__.py"), "", "| module | what it is for |",
                  "| --- | --- |"]  # fmt: skip
        for module in sorted(package.rglob("*.py")):
            if module.name == "__init__.py" and module.parent == package:
                continue
            name = module.relative_to(SRC).as_posix()
            lines.append(f"| `{name}` | {summary(module)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = parser.parse_args()
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print("docs/modules.md is stale: run python scripts/module_map.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
