"""The shape of python/krnl: no import circle, no module importing a higher layer than its own (the
layer table in krnl/__init__.py's docstring), and no file over 400 lines.

The imports are read with ast, without importing anything: `import krnl.x`, `from krnl.x import y`
and the relative forms, wherever they stand. Imports inside functions count like top-level ones:
such an import is as much a dependency (it runs each time the function does, and a circle or an
inverted layer through it fails then rather than at import time), and deferring an import must
not be a way to hide a circle. What is not counted is the import of a package's __init__ that
Python performs before any of its submodules: a submodule may be imported while its package is
still initialising, so that edge makes no circle; it is checked separately, by requiring each
package's __init__ to sit no higher than its submodules. importlib calls are not seen: the one
there is (krnl.bench.session) loads the peer libraries, torch and mlx, not krnl."""

import ast
import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "python" / "krnl"
NATIVE = {"_core"}  # compiled extensions: no source file here
MAX_LINES = 400


def module_name(path, root=ROOT):
    """Module name relative to krnl: "__init__" for the package itself, "bench" for
    krnl/bench/__init__.py, "bench.cli" for krnl/bench/cli.py."""
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def _name(parts):
    return ".".join(parts) or "__init__"


def module_imports(path, known, root=ROOT):
    """(the krnl modules the file at `path` imports, the imports of krnl names that are no module).
    `known` holds the package's module names."""
    me = module_name(path, root)
    parts = () if me == "__init__" else tuple(me.split("."))
    package = parts if path.name == "__init__.py" else parts[:-1]
    found, unresolved = set(), set()

    def add(target, what):
        if _name(target) in known:
            found.add(_name(target))
        else:
            unresolved.add(what)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "krnl" or alias.name.startswith("krnl."):
                    add(tuple(alias.name.split(".")[1:]), alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not (node.module == "krnl" or node.module.startswith("krnl.")):
                    continue
                base = tuple(node.module.split(".")[1:])
            else:
                rest = tuple(node.module.split(".")) if node.module else ()
                base = package[:len(package) - (node.level - 1)] + rest
            for alias in node.names:
                # `from . import adapter` names a module; `from .model import LoraConfig`, a name in one.
                sub = base + (alias.name,)
                add(sub if _name(sub) in known else base, f"{'.' * node.level}{node.module or ''}:{alias.name}")
    found.discard(me)
    return found, unresolved


def import_graph():
    files = sorted(ROOT.rglob("*.py"))
    known = {module_name(p) for p in files} | NATIVE
    graph, unresolved = {n: set() for n in NATIVE}, {}
    for p in files:
        graph[module_name(p)], bad = module_imports(p, known)
        if bad:
            unresolved[module_name(p)] = sorted(bad)
    return graph, unresolved


def find_cycle(graph):
    """One import circle of {module: {imported modules}} as [a, b, ..., a], or None."""
    state, stack = {}, []  # state: 1 while on the DFS path, 2 once finished

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def read_layers():
    """[(layer name, [module patterns])], lowest first, from the table in krnl/__init__.py's
    docstring: the indented lines of the block that starts with the `ops` layer."""
    doc = ast.get_docstring(ast.parse((ROOT / "__init__.py").read_text(encoding="utf-8")))
    lines = doc.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.split()[:2] == ["ops", "__init__"]), None)
    assert start is not None, "krnl/__init__.py's docstring lost its layer table (a line 'ops  __init__ ...')"
    layers = []
    for ln in lines[start:]:
        if not ln.startswith("    ") or not ln.strip():
            break
        name, *modules = ln.split()
        layers.append((name, modules))
    return layers


def layers_of(layers, module):
    """Indices of the layers whose patterns match `module` (exactly one, in a sound table)."""
    return [i for i, (_, pats) in enumerate(layers) if any(fnmatch.fnmatchcase(module, p) for p in pats)]


def layer_violations(graph, layers):
    """["a (layer) imports b (higher layer)"] for every import that goes up the table."""
    out = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            la, lb = layers_of(layers, a)[0], layers_of(layers, b)[0]
            if lb > la:
                out.append(f"{a} ({layers[la][0]}) imports {b} ({layers[lb][0]})")
    return out


# ---------------------------------------------------------------------------------------------
# The checks can fail: each finds what was planted in a made-up graph.


def test_find_cycle_finds_a_planted_circle():
    dag = {"cli": {"train", "model"}, "train": {"model"}, "model": {"ops"}, "ops": set()}
    assert find_cycle(dag) is None
    planted = dict(dag, ops={"train"})  # ops -> train -> model -> ops
    cycle = find_cycle(planted)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert set(cycle) == {"ops", "train", "model"}
    assert all(b in planted[a] for a, b in zip(cycle, cycle[1:]))
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_layer_check_finds_an_upward_import():
    layers = [("ops", ["ops"]), ("model", ["model"]), ("cli", ["cli", "bench.*"])]
    graph = {"ops": set(), "model": {"ops"}, "cli": {"model"}, "bench.w1": {"model", "cli"}}
    assert layer_violations(graph, layers) == []
    graph["model"] = {"ops", "bench.w1"}
    assert layer_violations(graph, layers) == ["model (model) imports bench.w1 (cli)"]


def test_import_reader_sees_every_form(tmp_path):
    pkg = tmp_path / "krnl"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "a.py", "b.py", "sub/__init__.py", "sub/c.py"):
        (pkg / f).write_text("")
    (pkg / "sub" / "d.py").write_text(
        "import numpy\nimport krnl\nfrom krnl.a import x\nfrom .. import b\nfrom . import c\n"
        "def f():\n    from ..nowhere import y\n")
    known = {"__init__", "a", "b", "sub", "sub.c", "sub.d"}
    found, unresolved = module_imports(pkg / "sub" / "d.py", known, root=pkg)
    assert found == {"__init__", "a", "b", "sub.c"}
    assert unresolved == {"..nowhere:y"}


# ---------------------------------------------------------------------------------------------
# The package itself.


def test_every_import_names_a_module():
    _, unresolved = import_graph()
    assert unresolved == {}, f"imports of krnl names that are no module: {unresolved}"


def test_no_import_circle():
    graph, _ = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_every_module_has_exactly_one_layer():
    graph, _ = import_graph()
    layers = read_layers()
    assert [name for name, _ in layers] == ["ops", "io", "quant", "models", "formats", "train", "serve", "bench", "cli"]
    wrong = {m: [layers[i][0] for i in layers_of(layers, m)] for m in graph if len(layers_of(layers, m)) != 1}
    assert wrong == {}, f"modules in no layer or in several (add them to krnl/__init__.py's table): {wrong}"


def folder_violations(modules, layers):
    """["module (layer)"] for every module outside its layer's folder: a module in krnl/x/ belongs to
    layer x, and the lowest layer holds the files at the top (plus __main__, which the table may
    put in any layer: `python -m krnl` is the CLI)."""
    names, out = {n for n, _ in layers}, []
    for m in sorted(modules):
        found = layers_of(layers, m)
        if len(found) != 1:
            continue  # test_every_module_has_exactly_one_layer reports it
        name = layers[found[0]][0]
        folder = m.split(".")[0] if "." in m or m in names else layers[0][0]  # a package's __init__ is its folder's
        if folder != name and m != "__main__":
            out.append(f"{m} ({name})")
    return out


def test_folder_check_finds_a_module_in_the_wrong_folder():
    layers = [("ops", ["__init__", "profiler"]), ("models", ["models", "models.*", "tune"]),
              ("cli", ["cli", "cli.*", "__main__"])]
    modules = ["__init__", "profiler", "models", "models.model", "cli", "cli.main", "__main__"]
    assert folder_violations(modules, layers) == []
    assert folder_violations(modules + ["tune"], layers) == ["tune (models)"]
    layers[1][1].append("cli.args")
    layers[2][1].remove("cli.*")
    layers[2][1].append("cli.main")
    assert folder_violations(modules + ["cli.args"], layers) == ["cli.args (models)"]


def test_every_layer_is_a_folder():
    graph, _ = import_graph()
    layers = read_layers()
    assert folder_violations(graph, layers) == []
    folders = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert folders == {name for name, _ in layers[1:]}


def test_no_import_goes_up_a_layer():
    graph, _ = import_graph()
    assert layer_violations(graph, read_layers()) == []


def test_packages_sit_no_higher_than_their_modules():
    # Importing krnl.x runs krnl/__init__.py first: a package's __init__ is a dependency of each
    # of its modules even though no import statement says so.
    graph, _ = import_graph()
    layers = read_layers()
    for pkg in ["__init__"] + [m for m in graph if (ROOT / m.replace(".", "/") / "__init__.py").is_file()]:
        inside = [m for m in graph if pkg == "__init__" or m.startswith(pkg + ".")]
        lp = layers_of(layers, pkg)[0]
        assert all(layers_of(layers, m)[0] >= lp for m in inside), pkg


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_file_size(path):
    rel = path.relative_to(ROOT).as_posix()
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"{rel} has {n} lines (at most {MAX_LINES}): split it"



def test_no_package_file_is_ignored_by_git():
    # The wheel and the sdist leave out what .gitignore names: a package folder matching a pattern
    # meant for the top (dist/, build/) would install without its modules.
    import shutil
    import subprocess

    repo = ROOT.parents[1]
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    files = [str(p.relative_to(repo)) for p in sorted(ROOT.rglob("*.py"))]
    r = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=repo, input="\n".join(files),
                       capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stderr
    assert r.stdout.split() == [], f"files of the package that .gitignore names: {r.stdout.split()}"
