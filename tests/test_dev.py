"""The research probes under dev/ stay buildable: every Python probe compiles and every name it
imports from krnl exists (the probes run only on a CUDA machine, so this is what CI can keep true),
every shell script parses, and, where nvcc exists, every CUDA probe compiles for the H200
(attention_probe.cpp needs the cuDNN frontend's headers, which only the H200 phase brings). Each
file has its line in dev/cuda/README.md, and every measured file under dev/results and
bench/results its line in that folder's README."""
import ast
import importlib
import py_compile
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT / "dev" / "cuda"
PROBES = sorted(p for p in DEV.iterdir() if p.name != "README.md")


def readme_names(folder):
    """The file names a folder's README.md names in backticks, `a-{1b,8b}.json` standing for both."""
    named = set()
    for token in re.findall(r"`([^`]+)`", (folder / "README.md").read_text()):
        m = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", token)
        named |= {m[1] + x + m[3] for x in m[2].split(",")} if m else {token}
    return named


def test_every_probe_has_its_purpose():
    missing = [p.name for p in PROBES if p.name not in readme_names(DEV)]
    assert not missing, f"dev/cuda/README.md has no line for {missing}"


def _krnl_imports(tree):
    """(module, name or None) for each `import krnl...` / `from krnl... import name`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((a.name, None) for a in node.names if a.name.split(".")[0] == "krnl")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "krnl":
            yield from ((node.module, a.name) for a in node.names)


@pytest.mark.parametrize("path", [p for p in PROBES if p.suffix == ".py"], ids=lambda p: p.name)
def test_python_probe_compiles_and_its_krnl_names_exist(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "x.pyc"), doraise=True)
    found = list(_krnl_imports(ast.parse(path.read_text())))
    assert found, f"{path.name} imports nothing from krnl: is it still a krnl probe?"
    for module, name in found:
        m = importlib.import_module(module)
        if name is not None and not hasattr(m, name):
            importlib.import_module(f"{module}.{name}")  # a submodule, or ImportError naming it


@pytest.mark.parametrize("path", [p for p in PROBES if p.suffix == ".sh"], ids=lambda p: p.name)
def test_shell_script_parses(path):
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc: the CUDA probes are compiled where it exists")
@pytest.mark.parametrize("path", [p for p in PROBES if p.suffix == ".cu"], ids=lambda p: p.name)
def test_cuda_probe_compiles(path, tmp_path):
    # compile only (no link): what the H200's phase builds, for its architecture
    r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-I", str(ROOT / "csrc"), "-c", str(path),
                        "-o", str(tmp_path / "probe.o")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("folder", ["dev/results", "bench/results"])
def test_every_result_file_says_what_made_it(folder):
    # A measured file nobody can trace is a figure nobody can check: each has its README line.
    d = ROOT / folder
    named = readme_names(d)
    missing = [p.name for p in sorted(d.iterdir()) if p.name != "README.md" and p.name not in named]
    assert not missing, f"{folder}/README.md has no line for {missing}"


def test_docs_cite_result_files_that_exist():
    cited = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "dev" / "performance-history.md"]:
        cited |= set(re.findall(r"(?:bench|dev)/results/[\w.-]+\.(?:json|txt)", doc.read_text()))
    assert cited, "no result file cited: did the docs stop citing their data?"
    gone = sorted(c for c in cited if not (ROOT / c).is_file())
    assert not gone, f"cited but not in the tree: {gone}"
