"""Imports between the packages point one way, so each can be read (and replaced) from below:

trainer_client  → ffplane_contract, ffplane_contract
statestore      → ffplane_contract, ffplane_runtime.httpserver
dataserver      → nothing of the others
ffplane_harness → anything (it starts clusters; nothing imports it but tests, bench, the CLI)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dataserver", "statestore", "trainer_client", "ffplane_harness")
ALLOWED = {
    "dataserver": (),
    "statestore": ("ffplane_contract", "ffplane_runtime.httpserver"),
    "trainer_client": ("ffplane_contract", "ffplane_contract"),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if node.module in PACKAGES]
    return found


def _allowed(package: str, target: str) -> bool:
    top = target.split(".")[0]
    if top not in PACKAGES or top == package:
        return True
    return any(target == a or target.startswith(a + ".") for a in ALLOWED[package])


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_only_down(package: str) -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, target in _imports(path)
        if not _allowed(package, target)
    ]
    assert not wrong, "imports against the layout (tests/test_layout.py):\n" + "\n".join(wrong)


def test_the_check_sees_a_wrong_import() -> None:
    assert not _allowed("dataserver", "trainer_client.pagemap")
    assert not _allowed("trainer_client", "statestore.durable")
    assert _allowed("trainer_client", "ffplane_contract.control")
