"""The layers import one way (docs/architecture.md): a module may import its own layer and the layers
below it, never one above, and the library never imports `experiments`. Each subpackage imports alone."""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bottom to top; a module belongs to the longest matching prefix
LAYERS = [
    "pallas_kernels",
    "dsv_jax.config",
    "dsv_jax.data",
    "dsv_jax.attention",
    "dsv_jax.dsv",
    "dsv_jax.model",
    "dsv_jax.parallel",
    "dsv_jax.train",
    "dsv_jax.sample",
    "dsv_jax.evaluate",
    "dsv_jax.export",
    "dsv_jax.cli",
]
# inference sits beside training: sample, evaluate and export use the trainer's checkpoints, and the trainer
# writes its end-of-run sample through dsv_jax.sample
SAME_LAYER = {
    "dsv_jax.train": "dsv_jax.sample",
    "dsv_jax.evaluate": "dsv_jax.sample",
    "dsv_jax.export": "dsv_jax.sample",
}


def layer_of(module: str) -> int | None:
    best = None
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            best = i
    return best


def rank(module: str) -> int | None:
    i = layer_of(module)
    if i is None:
        return None
    name = LAYERS[i]
    return layer_of(SAME_LAYER[name]) if name in SAME_LAYER else i


def imports():
    """(module, imported module, line) of every import statement of the two packages, lazy ones included."""
    for package in ("dsv_jax", "pallas_kernels"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        for alias in node.names:
                            yield module, alias.name, node.lineno
                    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                        yield module, node.module, node.lineno


def test_no_import_goes_up_a_layer_and_none_reaches_experiments():
    problems = []
    for module, target, line in imports():
        if target == "experiments" or target.startswith("experiments."):
            problems.append(f"{module}:{line} imports {target} (not part of the package)")
        a, b = rank(module), rank(target)
        if a is not None and b is not None and b > a:
            problems.append(f"{module}:{line} imports {target}, a higher layer")
    assert not problems, "\n".join(problems)


def test_the_checker_sees_a_back_edge():
    assert rank("dsv_jax.attention.registry") < rank("dsv_jax.dsv.backend") < rank("dsv_jax.model.dit")
    assert rank("dsv_jax.train.trainer") == rank("dsv_jax.sample") < rank("dsv_jax.cli")
    assert any(t.startswith("dsv_jax.attention") for m, t, _ in imports() if m.startswith("dsv_jax.model"))


@pytest.mark.parametrize(
    "package",
    [
        "pallas_kernels",
        "dsv_jax.config",
        "dsv_jax.data",
        "dsv_jax.attention",
        "dsv_jax.dsv",
        "dsv_jax.model",
        "dsv_jax.parallel",
        "dsv_jax.train",
        "dsv_jax.cli",
    ],
)
def test_each_subpackage_imports_alone(package):
    r = subprocess.run(
        [sys.executable, "-c", f"import {package}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
