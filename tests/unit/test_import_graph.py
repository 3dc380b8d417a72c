"""No import cycle at load time anywhere in the package, and no production module reaching
into the testing wing.

A cycle between modules works only while the order in which they are first imported happens to
suit it; the next import added elsewhere breaks it at load time. The graph is read from the
source: module-level imports only (an import inside a function runs later, one under
`if TYPE_CHECKING:` never), and importing `a.b.c` also runs `a.b`'s `__init__`.

`rollout_recovery.testing` (the fault-injecting filesystem, the crash campaigns) is test
machinery: no module outside it may import it, at load time or later, nor name it in a string
(an importlib target). It reaches production through seams production offers instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rollout_recovery"
TESTING = "rollout_recovery.testing"


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at `root`."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                pending += node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody
            pending += [s for h in node.handlers for s in h.body]
    return found


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _import_targets(
    node: ast.Import | ast.ImportFrom, package: str, files: dict[str, Path]
) -> set[str]:
    """The dotted names one import statement in `package` imports."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, *([base] if base else [])])
    targets = set()
    for alias in node.names:  # `from pkg import mod` imports a module
        full = f"{base}.{alias.name}"
        targets.add(full if full in files else base)
    return targets


def load_time_graph(root: Path) -> dict[str, set[str]]:
    """Each module's package modules run when it is first imported."""
    files = module_files(root)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = _package_of(name, path)
        targets = set()
        for node in _top_level_imports(ast.parse(path.read_text())):
            targets |= _import_targets(node, package, files)
        deps = set()
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # every enclosing package's __init__ runs too
                prefix = ".".join(parts[:i])
                if prefix in files and prefix != name and not name.startswith(prefix + "."):
                    deps.add(prefix)
        graph[name] = deps
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_package_has_no_import_cycle_at_load_time():
    graph = load_time_graph(PACKAGE)
    assert len(graph) > 50 and "rollout_recovery.data_plane.snapshot_io" in graph
    assert find_cycles(graph) == []


def test_the_check_finds_a_cycle_through_a_package_init(tmp_path):
    """A package whose `__init__` imports a module that imports a sibling, which imports the
    first module back: the cycle runs through the `__init__`, as a real one did here."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.a import A\n")
    (pkg / "sub" / "a.py").write_text("from pkg.b import B\nA = 1\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg.c import C\n"
        "def late():\n    from pkg.c import C\n"
        "from .sub import a\nB = 2\n"
    )
    (pkg / "c.py").write_text("from pkg.b import B\n")
    graph = load_time_graph(pkg)
    assert graph["pkg.c"] == {"pkg.b"} and "pkg.c" not in graph["pkg.b"]
    assert find_cycles(graph) == [["pkg.b", "pkg.sub", "pkg.sub.a"]]


def _inside(name: str, wing: str) -> bool:
    return name == wing or name.startswith(wing + ".")


def reaching_into(root: Path, wing: str) -> dict[str, list[str]]:
    """Modules outside `wing` that import it anywhere (at load time or inside a function) or
    name it in a string -> what they import or name."""
    files = module_files(root)
    found: dict[str, list[str]] = {}
    for name, path in files.items():
        if _inside(name, wing):
            continue
        hits = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                targets = _import_targets(node, _package_of(name, path), files)
                hits |= {t for t in targets if _inside(t, wing)}
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and wing in node.value
            ):
                hits.add(repr(node.value)[:80])
        if hits:
            found[name] = sorted(hits)
    return found


def test_no_production_module_imports_the_testing_wing():
    assert (PACKAGE / "testing" / "faultfs.py").exists()
    assert reaching_into(PACKAGE, TESTING) == {}


def test_the_check_finds_an_import_of_the_testing_wing(tmp_path):
    """Late imports, relative ones and an importlib target by name count; the wing's own
    imports of itself do not."""
    pkg = tmp_path / "pkg"
    (pkg / "testing").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "testing" / "__init__.py").write_text("from pkg.testing import fake\n")
    (pkg / "testing" / "fake.py").write_text("from pkg import prod\n")
    (pkg / "prod.py").write_text(
        "import importlib\n"
        "def late():\n    from .testing.fake import X\n"
        "def by_name():\n    return importlib.import_module('pkg.testing.fake')\n"
    )
    (pkg / "clean.py").write_text("from pkg import prod\n")
    found = reaching_into(pkg, "pkg.testing")
    assert found == {"pkg.prod": ["'pkg.testing.fake'", "pkg.testing.fake"]}


# The shipped driver is a loop like a user's: the public API, the config, the errors and its own
# training modules (policy, loss, checkpoint format), nothing of the project's internals.
DRIVER_MAY_IMPORT = ("rollout_recovery.run", "rollout_recovery.trainer.producer",
                     "rollout_recovery.config", "rollout_recovery.errors",
                     "rollout_recovery.training")  # fmt: skip


def project_imports(path: Path) -> set[str]:
    """Every rollout_recovery module `path` imports, at load time or later."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.split(".")[0] == "rollout_recovery"}


def outside_public_api(path: Path) -> set[str]:
    return {m for m in project_imports(path)
            if not any(m == a or m.startswith(a + ".") for a in DRIVER_MAY_IMPORT)}  # fmt: skip


def test_the_shipped_driver_uses_only_the_public_api():
    assert outside_public_api(PACKAGE / "training" / "driver.py") == set()
    for module in ("checkpoint", "grpo", "policy"):  # its own training modules
        assert outside_public_api(PACKAGE / "training" / f"{module}.py") == set(), module


def test_the_driver_check_finds_an_internal_import(tmp_path):
    loop = tmp_path / "loop.py"
    loop.write_text("def f():\n    from rollout_recovery.trainer.run_plan import plan_restore\n")
    assert outside_public_api(loop) == {"rollout_recovery.trainer.run_plan"}
