"""The package's rooms import only downward, and no module imports itself back through a cycle."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "postnorm"

# A room may import from rooms of a lower rank and from itself (README.md, "Layout").
RANKS = {
    "errors": 0,
    "config": 1, "diagnostics": 1, "files": 1, "kernels": 1, "theory": 1, "timing": 1,
    "data": 2, "model": 2, "runtime": 2,
    "workdir": 3,
    "train": 4,
    "analysis": 5,
    "sweep": 6,
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: pathlib.Path) -> set[str]:
    """The ``postnorm`` and ``configs`` modules ``path`` imports (``from a import b`` counts as
    a.b when a.b is a module, else as a)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = any((PACKAGE.parent / sub.replace(".", "/")).with_suffix(s).exists()
                                for s in (".py", "")) and sub.startswith("postnorm")
                found.add(sub if is_module else node.module)
    return {name for name in found if name.split(".")[0] in ("postnorm", "configs")}


def import_graph() -> dict[str, set[str]]:
    return {module_name(path): project_imports(path) for path in PACKAGE.rglob("*.py")}


def room(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'importer -> imported' for every import of a room of the same or a higher rank than
    the importer's (its own room excepted), or of anything outside the package's rooms."""
    bad = []
    for importer, imported in graph.items():
        for target in sorted(imported):
            if importer == "postnorm" or target == "postnorm":
                bad.append(f"{importer} -> {target}")
                continue
            mine, theirs = room(importer), room(target)
            if target.split(".")[0] != "postnorm" or theirs not in RANKS or (
                    theirs != mine and RANKS[theirs] >= RANKS[mine]):
                bad.append(f"{importer} -> {target}")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles among the graph's modules (one path per cycle found by DFS)."""
    found, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_every_room_has_a_rank():
    rooms = {room(module) for module in import_graph() if module != "postnorm"}
    assert rooms == set(RANKS)


def test_imports_point_down_the_layering():
    assert upward_imports(import_graph()) == []


def test_there_is_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_library_does_not_import_the_config_files():
    graph = import_graph()
    assert [m for m, imported in graph.items() if any(i.startswith("configs") for i in imported)
            ] == []


@pytest.mark.parametrize("graph,upward,cycle", [
    ({"postnorm.model.layers": {"postnorm.train.steps"}}, ["postnorm.model.layers -> "
                                                           "postnorm.train.steps"], []),
    ({"postnorm.model.spec": {"postnorm.data.errors"}}, ["postnorm.model.spec -> "
                                                         "postnorm.data.errors"], []),
    ({"postnorm.train.state": {"configs.default"}}, ["postnorm.train.state -> configs.default"],
     []),
    ({"postnorm.train.a": {"postnorm.train.b"}, "postnorm.train.b": {"postnorm.train.a"}}, [],
     [["postnorm.train.a", "postnorm.train.b", "postnorm.train.a"]]),
    ({"postnorm.train.a": {"postnorm.model.spec", "postnorm.errors"}}, [], []),
])
def test_the_checks_catch_what_they_are_for(graph, upward, cycle):
    assert upward_imports(graph) == upward
    assert cycles(graph) == cycle


def _flags_defined(module: pathlib.Path) -> set[str]:
    """The absl flag names ``module`` defines (``flags.DEFINE_*("name", ...)`` and
    ``config_flags.DEFINE_config_file("name", ...)``)."""
    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr.startswith("DEFINE") and node.args
                and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value)
    return names


def test_the_tests_import_no_two_scripts_that_define_one_flag():
    """pytest imports every test module into its workers: two scripts imported by tests that
    define the same absl flag fail collection (DuplicateFlagError). A script's test runs it in a
    subprocess instead."""
    scripts = PACKAGE.parent / "experiments"
    imported = set()
    for path in (PACKAGE.parent / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "experiments":
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [
                    alias.name for alias in node.names]
                imported |= {n.split(".")[1] for n in names
                             if n and n.startswith("experiments.") and n.count(".") == 1}
    owners: dict[str, list[str]] = {}
    for script in sorted(imported):
        for flag in _flags_defined(scripts / f"{script}.py"):
            owners.setdefault(flag, []).append(script)
    assert {flag: s for flag, s in owners.items() if len(s) > 1} == {}
