"""The layers import one way (docs/architecture.md): a module may import its own layer and the layers
below it, never one above, and the library never imports `experiments`. No module imports itself back
through others (no import cycle), and each kernel keeps its shape: the implementations import only their
reference and the shared helpers. Each subpackage imports alone."""

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
    "dsv_jax.solvers",
    "dsv_jax.labels",
    "dsv_jax.evaluate",
    "dsv_jax.export",
    "dsv_jax.wan",
    "dsv_jax.cli",
]
# inference sits beside training: sample, evaluate and export use the trainer's checkpoints, and the trainer
# writes its end-of-run sample through dsv_jax.sample (its solvers and labels are the sampler's); dsv_jax.wan
# (Wan's weights in and out) builds on export and train, and the CLI on it
SAME_LAYER = {
    "dsv_jax.train": "dsv_jax.sample",
    "dsv_jax.solvers": "dsv_jax.sample",
    "dsv_jax.labels": "dsv_jax.sample",
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


def module_files() -> dict[str, tuple[str, bool]]:
    """{module: (path, whether it is a package's __init__)} of the two packages."""
    out = {}
    for package in ("dsv_jax", "pallas_kernels"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[module.removesuffix(".__init__")] = (path, name == "__init__.py")
    return out


MODULES = module_files()


def _imported(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The modules a `from ... import ...` statement imports: `from pkg import mod` imports pkg.mod where
    that is a module of ours (else pkg itself); relative imports are resolved against `module`."""
    base = node.module or ""
    if node.level:
        parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
        base = ".".join(parts + ([base] if base else []))
    targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    return list(dict.fromkeys(targets))


def imports():
    """(module, imported module, line) of every import statement of the two packages, lazy ones (inside
    functions) included."""
    for module, (path, is_package) in MODULES.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield module, alias.name, node.lineno
            elif isinstance(node, ast.ImportFrom):
                for target in _imported(module, is_package, node):
                    yield module, target, node.lineno


def import_graph() -> dict[str, dict[str, int]]:
    """{module: {module of ours it imports: the line of the first such import}}."""
    graph = {module: {} for module in MODULES}
    for module, target, line in imports():
        if target in MODULES and target != module:
            graph[module].setdefault(target, line)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle [a, b, ..., a] through each strongly connected group of modules (Tarjan's algorithm)."""
    order, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = {v}
            while stack[-1] != v:
                group.add(stack.pop())
            on_stack.difference_update(group)
            stack.pop()
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in order:
            visit(v)
    cycles = []
    for group in groups:  # the shortest way from the group's first module back to it, inside the group
        start = min(group)
        paths, seen = {start: [start]}, {start}
        queue = [start]
        while queue:
            v = queue.pop(0)
            nxt = next((w for w in graph[v] if w == start), None)
            if nxt is not None:
                cycles.append(paths[v] + [start])
                break
            for w in sorted(graph[v]):
                if w in group and w not in seen:
                    seen.add(w)
                    paths[w] = paths[v] + [w]
                    queue.append(w)
    return cycles


def test_no_import_goes_up_a_layer_and_none_reaches_experiments():
    problems = []
    for module, target, line in imports():
        if target == "experiments" or target.startswith("experiments."):
            problems.append(f"{module}:{line} imports {target} (not part of the package)")
        a, b = rank(module), rank(target)
        if a is not None and b is not None and b > a:
            problems.append(f"{module}:{line} imports {target}, a higher layer")
    assert not problems, "\n".join(problems)


# helpers every layer may import (they import no other module of ours), and the package's entry points
NO_LAYER = {"dsv_jax", "dsv_jax.__main__", "dsv_jax.errors", "dsv_jax.host_memory", "dsv_jax.progress"}


def test_every_module_has_a_layer():
    """A module outside LAYERS is never checked: a back-edge into or out of it would pass unseen."""
    unplaced = sorted(m for m in MODULES if m.startswith("dsv_jax") and rank(m) is None and m not in NO_LAYER)
    assert not unplaced, f"modules in no layer (add them to LAYERS or SAME_LAYER): {unplaced}"
    for helper in NO_LAYER - {"dsv_jax", "dsv_jax.__main__"}:
        ours = [t for m, t, _ in imports() if m == helper and t.startswith("dsv_jax")]
        assert not ours, f"{helper} is in no layer but imports {ours}"


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
        "dsv_jax.wan",
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


def test_no_import_cycle():
    """No module of dsv_jax or pallas_kernels imports itself back through others, counting imports inside
    functions too (they only postpone a cycle; a module on it cannot be read or changed alone)."""
    graph = import_graph()
    shown = [
        " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"
        for cycle in find_cycles(graph)
    ]
    assert not shown, "import cycles:\n" + "\n".join(shown)


def test_the_cycle_finder_sees_cycles_and_lazy_imports():
    graph = {"a": {"b": 1}, "b": {"c": 2, "d": 3}, "c": {"a": 4}, "d": {}, "e": {"a": 5}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    two = {"a": {"b": 1}, "b": {"a": 2}, "c": {"d": 1}, "d": {"c": 1, "a": 2}}
    assert sorted(find_cycles(two)) == [["a", "b", "a"], ["c", "d", "c"]]
    edges = import_graph()
    # a lazy `from pallas_kernels import module` inside a function counts as importing that module
    assert "pallas_kernels.sparse_attention_triton" in edges["pallas_kernels.sparse_attention"]
    assert "pallas_kernels.lowrank_topk_triton" in edges["pallas_kernels.lowrank_topk"]


# pallas_kernels: per kernel a dispatcher (the public module, named after the kernel), its reference
# (`<kernel>_reference`: the definition, input checks, shared helpers) and its implementations
# (`<kernel>_<impl>`, and their parts `<kernel>_<impl>_<part>`); and helpers that every kernel may share.
KERNELS = ("sparse_attention", "lowrank_topk", "adaln")
SHARED = ("mgpu_common", "tuning", "sparse_index", "partitioning", "lowering", "defaults", "triton_call")


def kernel_role(name: str) -> tuple[str, str]:
    """(kernel, role) of a pallas_kernels module, role "dispatcher" | "reference" | "implementation";
    ("", "shared") for a shared helper and the package itself."""
    if name in SHARED or name == "":
        return "", "shared"
    kernel = max((k for k in KERNELS if name == k or name.startswith(k + "_")), key=len, default=None)
    assert kernel, f"pallas_kernels.{name} is neither a kernel's module ({KERNELS}) nor a shared helper {SHARED}"
    if name == kernel:
        return kernel, "dispatcher"
    return kernel, "reference" if name == kernel + "_reference" else "implementation"


def allowed_imports(name: str) -> str:
    """What pallas_kernels module `name` may import of its package, as a predicate's description."""
    kernel, role = kernel_role(name)
    return {
        "shared": "shared helpers",
        "reference": "shared helpers",
        "implementation": f"shared helpers, {kernel}_reference and its own parts {name}_*",
        "dispatcher": f"shared helpers and {kernel}'s modules",
    }[role]


def may_import(name: str, target: str) -> bool:
    kernel, role = kernel_role(name)
    if kernel_role(target)[1] == "shared" and target:
        return True
    if role == "implementation":
        return target == kernel + "_reference" or target.startswith(name + "_")
    if role == "dispatcher":
        return kernel_role(target)[0] == kernel
    return False


def test_kernels_keep_their_shape():
    """A kernel's implementations (Triton, Mosaic GPU) import only its reference and the shared helpers; a
    reference and a shared helper import only shared helpers; a dispatcher only its own kernel's modules.
    A new module must be a kernel's (KERNELS) or a shared helper (SHARED)."""
    problems = []
    for module, target, line in imports():
        if module.startswith("pallas_kernels") and target.startswith("pallas_kernels."):
            name, other = module.removeprefix("pallas_kernels").lstrip("."), target.removeprefix("pallas_kernels.")
            if not may_import(name, other):
                problems.append(f"{module}:{line} imports {target}; it may import only {allowed_imports(name)}")
    assert not problems, "\n".join(problems)


def test_the_shape_check_tells_roles_apart():
    assert kernel_role("sparse_attention_mgpu_fwd") == ("sparse_attention", "implementation")
    assert kernel_role("lowrank_topk_reference") == ("lowrank_topk", "reference")
    assert may_import("sparse_attention_mgpu", "sparse_attention_mgpu_bwd")
    assert may_import("sparse_attention_token", "sparse_attention_token_kernels")  # jax-triton side, Triton side
    assert kernel_role("sparse_attention_token_kernels") == ("sparse_attention", "implementation")
    assert may_import("sparse_attention_triton", "sparse_attention_reference")
    assert not may_import("sparse_attention_triton", "sparse_attention")  # back to the dispatcher: a cycle
    assert not may_import("lowrank_topk_triton", "sparse_attention_triton")  # another kernel's implementation
    assert not may_import("sparse_attention_reference", "sparse_attention_triton")
    assert not may_import("tuning", "sparse_attention_reference")
    assert may_import("sparse_attention", "sparse_attention_triton") and may_import("adaln", "tuning")
    with pytest.raises(AssertionError, match="neither a kernel's module"):
        kernel_role("flash_attention")
