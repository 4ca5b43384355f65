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
    function belongs in the library (e.g. pallas_kernels.sparse_attention_reference.dense_masked_reference)."""
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


def test_readme_starts_with_the_install_and_stays_short():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the guide (docs/guide/) takes the rest"
    assert "## Install" in lines[:40], "README.md: '## Install' must come within the first 40 lines"
    install = lines[lines.index("## Install") :]
    assert any("pip install -e ." in line and "dsv-jax train" in line for line in install[:20])
    assert any('pip install -e ".[test]"' in line and "pytest" in line for line in install[:20])


def test_results_hold_current_runs_only():
    """One current JSON per benchmark at the top of experiments/results/ (superseded runs go to archive/<date>/),
    and RESULTS.md is current tables, not a log (the log is docs/journal.md)."""
    results = os.path.join(ROOT, "experiments", "results")
    files = [n for n in os.listdir(results) if os.path.isfile(os.path.join(results, n)) and "_quick" not in n]
    assert len(files) <= 40, f"{len(files)} files at the top of experiments/results/; archive superseded runs"
    with open(os.path.join(results, "RESULTS.md"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 600


def _literal_geometry_defaults(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            pairs = list(zip(args.args[len(args.args) - len(args.defaults) :], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            for arg, default in pairs:
                # 0 (the layout's tile) and 1 (single tokens) are meanings, not a geometry
                if (
                    arg.arg in ("q_tile", "kv_block")
                    and isinstance(default, ast.Constant)
                    and default.value not in (0, 1)
                ):
                    yield node.name, arg.arg, default.value, node.lineno


def test_the_default_sparse_geometry_lives_in_one_place():
    """Signatures take their q_tile / kv_block defaults from pallas_kernels.defaults, not a literal of their own."""
    problems = []
    for package in ("dsv_jax", "pallas_kernels"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as f:
                        tree = ast.parse(f.read())
                    for fn, arg, value, line in _literal_geometry_defaults(tree):
                        problems.append(f"{os.path.relpath(path, ROOT)}:{line} {fn}({arg}={value})")
    assert not problems, "use pallas_kernels.defaults (Q_TILE, KV_BLOCK):\n" + "\n".join(problems)


def test_the_geometry_check_sees_a_literal_default():
    tree = ast.parse("def f(q, *, q_tile=64, kv_block=KV_BLOCK):\n    pass\n")
    assert [(a, v) for _, a, v, _ in _literal_geometry_defaults(tree)] == [("q_tile", 64)]
