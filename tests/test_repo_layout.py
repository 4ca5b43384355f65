"""The house's layout rules that no other test would notice breaking."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _imported_modules(path: str):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_only_the_tests_of_experiments_import_experiments():
    """experiments/ is not part of the package: a library test that needs one of its functions means the
    function belongs in the library (e.g. pallas_kernels.dense_reference)."""
    problems = []
    tests = os.path.join(ROOT, "tests")
    for folder, _, files in os.walk(tests):
        if os.path.relpath(folder, tests).split(os.sep)[0] == "experiments":
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                for module in _imported_modules(path):
                    if module == "experiments" or module.startswith("experiments."):
                        problems.append(f"{os.path.relpath(path, ROOT)} imports {module}")
    assert not problems, "move these tests to tests/experiments/ or the code into the library:\n" + "\n".join(problems)


def test_the_checker_sees_an_experiments_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from experiments.harness import write_results\n")
    assert "experiments.harness" in list(_imported_modules(str(probe)))
