"""The layering of spd/: targets, drafters and the runtime never import the session, the configs, the engine, eval,
the server or the CLI (lower layers never import higher ones), at module level or inside a function."""

import ast
import os

import pytest

SPD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spd")
HIGHER = ("spd.session", "spd.config", "spd.engine", "spd.eval", "spd.serve", "spd.cli", "spd.train", "spd.fastest")


def imports(path: str) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, nested ones included."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
    return found


def higher(module: str) -> bool:
    return any(module == h or module.startswith(h + ".") for h in HIGHER)


@pytest.mark.parametrize("part", ["targets", "drafters", "runtime"])
def test_a_lower_part_imports_nothing_above_it(part):
    bad = []
    for directory, _, names in os.walk(os.path.join(SPD, part)):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                bad += [f"{os.path.relpath(path, SPD)}:{line} imports {module}" for line, module in imports(path)
                        if higher(module)]
    assert not bad, bad


def test_the_check_sees_a_nested_import(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from spd.session import open_session\n")
    assert [higher(m) for _, m in imports(str(path))] == [True]
    assert not higher("spd.sessions_of_nothing") and not higher("spd.sampling")
