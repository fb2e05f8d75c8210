"""The code's shape (issue 29): small functions with few parameters in the installed packages.

Why a test: a function of 60+ lines or a dozen parameters is where a later change goes wrong
unnoticed; the rule is checked here so it stays true, not just once.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ipc", "cpu_worker", "gpu_worker", "dovetail_runtime")
MAX_LINES = 60
MAX_PARAMETERS = 12  # self and cls not counted


def parameter_count(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = function.args
    count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
    count += (args.vararg is not None) + (args.kwarg is not None)
    positional = args.posonlyargs + args.args
    if positional and positional[0].arg in ("self", "cls"):
        count -= 1
    return count


def oversized_functions(path: Path, root: Path = ROOT) -> list[str]:
    """'path:line name (N lines, M parameters)' for each function past either limit."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            parameters = parameter_count(node)
            if lines > MAX_LINES or parameters > MAX_PARAMETERS:
                where = f"{path.relative_to(root)}:{node.lineno}"
                found.append(f"{where} {node.name} ({lines} lines, {parameters} parameters)")
    return found


def test_no_long_function_or_long_parameter_list_in_the_packages():
    found = [entry for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             for entry in oversized_functions(path)]
    assert found == [], "\n".join(found)


def test_the_shape_check_catches_a_long_function_and_many_parameters(tmp_path):
    module = tmp_path / "big.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    params = ", ".join(f"p{i}" for i in range(MAX_PARAMETERS + 1))
    allowed = ", ".join(f"p{i}" for i in range(MAX_PARAMETERS))
    module.write_text(f"def long():\n{body}\n\n\ndef wide({params}):\n    pass\n\n\n"
                      f"class C:\n    def fine(self, {allowed}):\n        pass\n")
    found = oversized_functions(module, tmp_path)
    assert [entry.split(" ")[1] for entry in found] == ["long", "wide"]
