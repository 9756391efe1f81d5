"""msl_dialect: metal/*.metal checked as MSL 3.x, the C++14 dialect Apple's compiler takes, on Linux.

The simulator compiles the kernels as C++20 against a C++17 shim, so C++17 in a kernel, or
anything MSL forbids, would first fail on a Mac. Per file:

1. The first line declares the MSL version it needs: `// msl: 3.1` (3.0 to 3.2; MSL 4 is C++17).
   It sets __METAL_VERSION__ (3.1 -> 310, as Apple's compiler does), so newer features
   declared in include/msl14.h behind it (bfloat: 3.1) are missing under a lower declaration.
   The host compiles the file with that version (library_msl_version in csrc/metal) and the
   macOS workflow with `metal -std=metalX.Y`. A file declares the lowest version that has all it
   uses, but not below 3.0, krnl's floor: the first version spelled -std=metal3.0 and
   MTLLanguageVersion3_0 (macOS 13); 2.x is spelled -std=macos-metal2.x and would only add
   macOS 11-12. Today every kernel declares 3.0: their newest feature is simdgroup_matrix (2.3).
   Code behind `#if KRNL_BF16` (the bf16 kernels; metal/kargs.h turns it on from MSL 3.1,
   `__METAL_VERSION__ >= 310`) is compiled by the host only for GPUs with native bf16, as MSL 3.1:
   a file that has such a block (or one on __METAL_VERSION__ >= 310 or __HAVE_BFLOAT__, which 3.1
   also defines) is checked twice, at its declared version (the block left out) and at 3.1 (in).
2. Attributes are validated against the MSL ones the simulator knows, then blanked (clang takes
   no attributes on the explicit instantiations that name kernels); `1.5h` becomes half(1.5f).
3. `-std=c++14 -fsyntax-only -nostdinc -pedantic-errors -Werror` against include/msl14.h: the
   subset of MSL the kernels use, declared in C++14, and no C++ standard library. Flags reject
   exceptions (-fno-exceptions), dynamic_cast/typeid (-fno-rtti), C++17 features
   (-pedantic-errors), variable-length arrays (-Wvla) and #include of the C++ standard library.
4. MSL's other restrictions (the specification's "Restrictions" on C++14, section 1.5.4 in 3.2,
   and its data types, which have no double): with clang, from its AST
   (-ast-dump=json): recursion (a call graph over the instantiated functions), lambdas, virtual
   functions, derived classes, new/delete, function pointers, any `double` (type or unsuffixed
   literal), goto, the noexcept operator, thread_local/register. Without clang, a text check of
   the preprocessed source finds the same constructs by their tokens and recursion by function
   name (coarser: overloads of one name count as one function; a call whose template arguments
   compute new values, h<N - 1>(x), is taken for compile-time recursion and not counted).

Every problem names the file and line. Usage: `python tools/mslsim/dialect/msl_dialect.py
[--cxx CXX] [--mode auto|ast|text] [FILE...]` (default: every metal/*.metal), or
`--msl-version FILE` to print a file's declared version. Environment: MSL_DIALECT_CXX.
"""
from __future__ import annotations

import bisect
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
REPO = HERE.parents[2]
# The include dirs of cmake/embed_metal.cmake: kargs.h in metal/, rng.h in csrc/core/.
DEFAULT_INCLUDE_DIRS = (REPO / "metal", REPO / "csrc" / "core")

# Versions `metal -std=metalX.Y` takes that are C++14-based. 2.x would need -std=macos-metal2.x and
# is older than every GPU the backend runs on (Apple7); 4.0 is C++17.
SUPPORTED_VERSIONS = ((3, 0), (3, 1), (3, 2))
VERSION_LINE = re.compile(r"// msl: (\d+)\.(\d+)(?=\s|$)")

# MSL attributes of compute kernels (besides the builtin-argument ones mslsim.transform knows).
MSL_ATTRIBUTES = {"kernel", "buffer", "threadgroup", "function_constant", "host_name",
                  "max_total_threads_per_threadgroup"}

# The compile of the preprocessed text (-nostdinc went to the preprocessor: MSL has no C++ standard
# library). -fno-exceptions and -fno-rtti make throw/try and dynamic_cast/typeid errors;
# -pedantic-errors makes C++17 features errors, not extensions. (Not -Wdouble-promotion: clang counts
# half -> float as one, which MSL does implicitly; the double checks below cover double.)
COMMON_FLAGS = ["-std=c++14", "-fsyntax-only", "-fno-exceptions", "-fno-rtti", "-pedantic-errors", "-Werror",
                "-Wall", "-Wvla"]
# arm64: LP64 like Apple GPUs, and clang has _Float16 there (not on x86-64 before clang 15).
CLANG_FLAGS = ["--target=arm64-apple-macos13"]
GCC_FLAGS = ["-Wno-unknown-pragmas"]  # `#pragma clang loop unroll(full)`


class DialectError(RuntimeError):
    """The check could not run (no compiler, unreadable file)."""


@dataclass(frozen=True)
class Problem:
    file: str
    line: int
    rule: str
    message: str

    def __str__(self):
        return f"{self.file}:{self.line}: {self.rule}: {self.message}"


@dataclass(frozen=True)
class Compiler:
    path: str
    is_clang: bool


def _display(name: str) -> str:
    """A path as the user knows it: relative to the working directory when inside it."""
    if name.startswith("<"):
        return name
    p = Path(name)
    try:
        return os.path.relpath(p.resolve(), Path.cwd()) if p.resolve().is_relative_to(Path.cwd()) else str(p)
    except (OSError, ValueError):
        return name


# ------------------------------------------------------------------------------------------------
# version declaration
# ------------------------------------------------------------------------------------------------
class VersionError(DialectError):
    """A missing or unusable `// msl: X.Y` first line."""

    def __init__(self, file: str, message: str):
        super().__init__(f"{file}:1: {message}")
        self.file, self.message = file, message


def parse_version_line(first_line: str, where: str = "<source>") -> tuple[int, int]:
    m = VERSION_LINE.match(first_line)
    if not m:
        raise VersionError(where, f"the first line must declare the MSL version the file needs, e.g. "
                                  f"'// msl: 3.0' (found {first_line[:60]!r})")
    v = (int(m.group(1)), int(m.group(2)))
    if v not in SUPPORTED_VERSIONS:
        known = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_VERSIONS)
        raise VersionError(where, f"MSL {v[0]}.{v[1]} is not one of {known} (the C++14-based versions "
                                  f"this check and `metal -std=metalX.Y` cover)")
    return v


BFLOAT_GUARD = re.compile(r"^\s*#\s*if\s+(?:KRNL_BF16\b|__METAL_VERSION__\s*>=\s*310\b|defined\s*\(?\s*__HAVE_BFLOAT__)",
                          re.M)


def checked_versions(path, declared: tuple[int, int]) -> list[tuple[int, int]]:
    """The versions a file is compiled at: the one it declares, and 3.1 too where the file has
    code behind KRNL_BF16 (compiled as 3.1 on GPUs with native bf16: csrc/metal/device.mm)."""
    text = Path(path).read_text(encoding="utf-8")
    if declared < (3, 1) and BFLOAT_GUARD.search(text):
        return [declared, (3, 1)]
    return [declared]


def declared_version(path) -> tuple[int, int]:
    """(major, minor) from the `// msl: X.Y` first line of a .metal file."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline().rstrip("\r\n")
    except OSError as e:
        raise DialectError(f"{path}: {e}") from None
    return parse_version_line(first, _display(str(path)))


# ------------------------------------------------------------------------------------------------
# compilers
# ------------------------------------------------------------------------------------------------
def _is_clang(path: str) -> bool:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return False
    return "clang" in out.lower()


def find_compiler(kind: str = "any") -> Compiler | None:
    """MSL_DIALECT_CXX if set, else clang++ (any version suffix), else (kind "any") g++ or c++."""
    env = os.environ.get("MSL_DIALECT_CXX")
    if env:
        path = shutil.which(env)
        if path is None:
            return None
        c = Compiler(path, _is_clang(path))
        return c if kind == "any" or c.is_clang == (kind == "clang") else None
    names = []
    if kind in ("any", "clang"):
        names += ["clang++"] + [f"clang++-{v}" for v in range(30, 13, -1)]
    if kind in ("any", "gcc"):
        names += ["g++", "c++"]
    for n in names:
        p = shutil.which(n)
        if p:
            return Compiler(p, _is_clang(p))
    return None


# ------------------------------------------------------------------------------------------------
# preprocessing and rewriting
# ------------------------------------------------------------------------------------------------
_MARKER = re.compile(r'#\s*(?:line\s+)?(\d+)\s+"((?:[^"\\]|\\.)*)"')
_SUMMARY = re.compile(r"\d+ (?:warnings? and \d+ )?errors? generated")
_DIAG = re.compile(r"^(?P<file>[^:\n]+?):(?P<line>\d+):(?:\d+:)? (?P<kind>fatal error|error|warning): (?P<msg>.*)$")


def _transform():
    # mslsim's masking (comments, literals and preprocessor lines blanked at unchanged offsets) and
    # its attribute tables; imported late so that --msl-version needs neither it nor numpy.
    if str(HERE.parent) not in sys.path:
        sys.path.insert(0, str(HERE.parent))
    return importlib.import_module("mslsim.transform")  # the module: the package exports a function of that name


def _line_origins(pre: str) -> list[tuple[str, int]]:
    """(file, line) of every line of preprocessed text, from its line markers."""
    out, cur_file, cur_line = [], "<unknown>", 1
    for text in pre.split("\n"):
        m = _MARKER.match(text) if text.startswith("#") else None
        if m:
            cur_file, cur_line = m.group(2).encode().decode("unicode_escape"), int(m.group(1))
            out.append((cur_file, 0))
            continue
        out.append((cur_file, cur_line))
        cur_line += 1
    return out


def _compile_problems(stderr: str, main: str) -> list[Problem]:
    probs = []
    for line in stderr.splitlines():
        m = _DIAG.match(line)
        if m:
            probs.append(Problem(_display(m.group("file")), int(m.group("line")), "compile",
                                 f"{m.group('kind')}: {m.group('msg')}"))
        elif re.search(r"\berror\b", line) and not line.startswith(" ") and not _SUMMARY.match(line):
            probs.append(Problem(main, 1, "compile", line.strip()))
    return probs


def _is_user(name: str) -> bool:
    if not name or name.startswith("<"):
        return False
    try:
        return not Path(name).resolve().is_relative_to(INCLUDE)
    except OSError:
        return True


def _check_attributes(files: list[str], tr) -> list[Problem]:
    """Every [[...]] in the user's files is an MSL attribute or a standard one."""
    known = MSL_ATTRIBUTES | tr.BUILTINS | tr.STD_ATTRIBUTES
    probs = []
    for name in files:
        try:
            text = Path(name).read_text(encoding="utf-8")
        except OSError:
            continue
        masked = tr.mask(text)
        for am in re.finditer(r"\[\[(.*?)\]\]", masked, re.S):
            inner = text[am.start(1):am.end(1)]
            for a, b in tr.split_top(inner):
                nm = re.match(r"\s*([\w:]+)", inner[a:b])
                if nm and nm.group(1) not in known:
                    probs.append(Problem(_display(name), text.count("\n", 0, am.start()) + 1, "attribute",
                                         f"[[{nm.group(1)}]] is not an MSL compute attribute"))
    return probs


def _rewrite(pre: str, tr) -> str:
    """Blank the non-standard attributes and spell half literals in C++14, keeping every newline."""
    m = tr.mask(pre)
    edits = []
    for am in re.finditer(r"\[\[(.*?)\]\]", m, re.S):
        nm = re.match(r"\s*([\w:]+)", am.group(1))
        if not (nm and nm.group(1) in tr.STD_ATTRIBUTES):
            edits.append((am.start(), am.end(), tr.blank(pre[am.start():am.end()])))
    for hm in re.finditer(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b", m):
        lit = hm.group(1) if re.search(r"[.eE]", hm.group(1)) else hm.group(1) + ".0"
        edits.append((hm.start(), hm.end(), f"half({lit}f)"))
    for a, b, rep in sorted(edits, reverse=True):
        pre = pre[:a] + rep + pre[b:]
    return pre


# ------------------------------------------------------------------------------------------------
# the AST checks (clang)
# ------------------------------------------------------------------------------------------------
_FUNCTION_KINDS = {"FunctionDecl", "CXXMethodDecl", "CXXConstructorDecl", "CXXDestructorDecl", "CXXConversionDecl"}
_DOUBLE = re.compile(r"\bdouble\b")
# a type that is itself a pointer or reference to a function or member function: "void (*)(int)",
# "int (S::*)(float)", "float (&)(float)" (not a function type taking one: that parameter's
# own declaration is reported)
_FUNC_PTR = re.compile(r"^[^(]*\((?:[\w:<>, ]+::)?[*&^]+[^()]*\)\s*\(")
_NODE_RULES = {
    "LambdaExpr": ("lambda", "lambda expression (MSL has none; write a struct with operator())"),
    "GotoStmt": ("goto", "goto (MSL has none)"),
    "IndirectGotoStmt": ("goto", "computed goto (MSL has none)"),
    "CXXNewExpr": ("new/delete", "new expression (MSL has no dynamic allocation)"),
    "CXXDeleteExpr": ("new/delete", "delete expression (MSL has no dynamic allocation)"),
    "CXXThrowExpr": ("exceptions", "throw (MSL has no exceptions)"),
    "CXXTryStmt": ("exceptions", "try block (MSL has no exceptions)"),
    "CXXDynamicCastExpr": ("rtti", "dynamic_cast (MSL has no RTTI)"),
    "CXXTypeidExpr": ("rtti", "typeid (MSL has no RTTI)"),
    "CXXNoexceptExpr": ("noexcept", "noexcept operator (not in MSL)"),
}


def _annotate_locations(tree, origin_of_offset):
    """Give every location in clang's JSON its original _file and _line.

    The compile reads the preprocessed text from stdin, so clang's own file and line are those of
    that text ("<stdin>"); its "presumed" ones (from the line markers) are written only where they
    change, ambiguously. The byte offset into the text is always there: map it through the text's
    line markers instead. clang writes a location's file only where it changes from the previous
    location printed, so the walk goes in document order."""
    state = {"file": None}

    def visit(x):
        if isinstance(x, dict):
            if "offset" in x:
                state["file"] = x.get("file", state["file"])
                x["_file"], x["_line"] = (origin_of_offset(x["offset"]) if state["file"] == "<stdin>"
                                          else (state["file"], None))
                return
            for v in x.values():
                visit(v)
        elif isinstance(x, list):
            for v in x:
                visit(v)

    visit(tree)


def _where(node) -> tuple[str | None, int | None]:
    loc = node.get("loc") or (node.get("range") or {}).get("begin") or {}
    if "expansionLoc" in loc:  # written inside a macro: report where the macro was used
        loc = loc["expansionLoc"]
    return loc.get("_file"), loc.get("_line")


def _ast_problems(tree, origin_of_offset, spelling) -> list[Problem]:
    _annotate_locations(tree, origin_of_offset)
    probs: list[Problem] = []
    canon_of: dict[str, str] = {}     # a redeclaration -> its first declaration
    names: dict[str, str] = {}
    edges: dict[str, dict[str, tuple[str, int]]] = {}  # caller -> callee -> first call site

    literal_lines = set()

    def report(node, rule, message):
        f, ln = _where(node)
        if _is_user(f):
            if rule == "double" and node.get("kind") == "FloatingLiteral":
                literal_lines.add((f, ln))  # the literal is the cause: its message wins on its line
            probs.append(Problem(_display(f), ln or 0, rule, message))

    def visit(node, fn, exempt_type):
        if not isinstance(node, dict):
            return
        kind = node.get("kind")
        implicit = node.get("isImplicit", False)
        if kind in _FUNCTION_KINDS:
            if "previousDecl" in node:
                canon_of[node["id"]] = node["previousDecl"]
            names[node["id"]] = node.get("name", "?")
            fn = node["id"]
        if not implicit:
            if kind in _NODE_RULES:
                report(node, *_NODE_RULES[kind])
            if node.get("virtual"):
                report(node, "virtual", f"virtual function '{node.get('name')}' (MSL has none)")
            if kind == "CXXRecordDecl" and node.get("bases"):
                report(node, "derived class",
                       f"'{node.get('name')}' derives from a base class (MSL has no derived classes)")
            if kind == "VarDecl" and node.get("tls"):
                report(node, "thread_local", f"thread_local '{node.get('name')}' (not in MSL)")
            if kind == "VarDecl" and node.get("storageClass") == "register":
                report(node, "register", f"register '{node.get('name')}' (not in MSL)")
            t = node.get("type") or {}
            types = " ".join(t.get(k, "") for k in ("qualType", "desugaredQualType"))
            if _DOUBLE.search(types):
                if kind == "FloatingLiteral":
                    tok = spelling((node.get("range") or {}).get("begin") or {}) or node.get("value", "")
                    what = f"floating literal {tok} without a suffix is a double: write {tok}f"
                else:
                    what = f"'{t.get('qualType')}'"
                report(node, "double", f"{what} (MSL has no double)")
            if not exempt_type and _FUNC_PTR.search(types):
                report(node, "function pointer", f"'{t.get('qualType')}' is a function pointer or reference "
                                                 "(MSL kernels here call functions directly)")
        if fn is not None:
            ref = None
            if kind == "DeclRefExpr" and (node.get("referencedDecl") or {}).get("kind") in _FUNCTION_KINDS:
                ref = node["referencedDecl"]["id"]
            elif kind == "MemberExpr":
                ref = node.get("referencedMemberDecl")
            if ref is not None:
                f, ln = _where(node)
                edges.setdefault(fn, {}).setdefault(ref, (f, ln))
        inner = node.get("inner") or []
        # a call's callee decays to a function pointer; that is a direct call, not a pointer
        is_call = kind in ("CallExpr", "CXXOperatorCallExpr", "CXXMemberCallExpr")
        for i, child in enumerate(inner):
            visit(child, fn, is_call and i == 0)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))  # deep expression trees
    try:
        visit(tree, None, False)
    finally:
        sys.setrecursionlimit(limit)

    def canon(i):
        seen = set()
        while i in canon_of and i not in seen:
            seen.add(i)
            i = canon_of[i]
        return i

    graph: dict[str, dict[str, tuple[str, int]]] = {}
    for caller, callees in edges.items():
        for callee, site in callees.items():
            if callee in names or callee in canon_of:
                graph.setdefault(canon(caller), {}).setdefault(canon(callee), site)
    lit = {(_display(f), ln or 0) for f, ln in literal_lines}
    probs = [p for p in probs if not (p.rule == "double" and (p.file, p.line) in lit and "literal" not in p.message)]
    name_of = {canon(i): n for i, n in names.items()}
    for cycle in _cycles(graph):
        sites = [graph[a][b] for a, b in zip(cycle, cycle[1:] + cycle[:1])]
        f, ln = next((site for site in sites if _is_user(site[0])), (None, None))
        if f is not None:  # reported at the first call of the cycle written in the user's code
            chain = " -> ".join(name_of.get(c, "?") for c in cycle + [cycle[0]])
            probs.append(Problem(_display(f), ln or 0, "recursion", f"recursive call {chain} (MSL has no recursion)"))
    return probs


def _cycles(graph: dict) -> list[list]:
    """One cycle per strongly connected component that has one (Tarjan, iterative)."""
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]
    for root in list(graph):
        if root in index:
            continue
        work = [(root, iter(graph.get(root, {})))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph.get(w, {}))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                comps.append(comp)
    cycles = []
    for comp in comps:
        members = set(comp)
        start = sorted(comp)[0]
        if len(comp) == 1 and start not in graph.get(start, {}):
            continue
        # shortest way back to start inside the component
        prev, frontier, found = {start: None}, [start], None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in graph.get(v, {}):
                    if w == start:
                        found = v
                        break
                    if w in members and w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path, v = [], found
        while v is not None:
            path.append(v)
            v = prev[v]
        cycles.append(path[::-1])
    return cycles


# ------------------------------------------------------------------------------------------------
# the text checks (any compiler)
# ------------------------------------------------------------------------------------------------
_TEXT_RULES = [
    ("goto", re.compile(r"\bgoto\b"), "goto (MSL has none)"),
    ("exceptions", re.compile(r"\b(?:throw|try|catch)\b"), "exception handling (MSL has no exceptions)"),
    ("virtual", re.compile(r"\bvirtual\b"), "virtual function (MSL has none)"),
    ("new/delete", re.compile(r"\b(?:new|delete)\b"), "new/delete (MSL has no dynamic allocation)"),
    ("rtti", re.compile(r"\b(?:dynamic_cast|typeid)\b"), "RTTI (MSL has none)"),
    ("noexcept", re.compile(r"(?:[=(,!&|?:]|\breturn)\s*noexcept\s*\("), "noexcept operator (not in MSL)"),
    ("thread_local", re.compile(r"\bthread_local\b"), "thread_local (not in MSL)"),
    ("register", re.compile(r"\bregister\b"), "register (not in MSL)"),
    ("double", re.compile(r"\bdouble\b"), "'double' (MSL has no double)"),
    ("lambda", re.compile(r"(?:^|[=(,{;?:]|\breturn)\s*\[[^\[\]]*\]\s*(?:\(|\{|mutable\b)"),
     "lambda expression (MSL has none; write a struct with operator())"),
    ("function pointer", re.compile(r"\(\s*(?:\w+\s*::\s*)?[*&]\s*\w*\s*\)\s*\("),
     "function pointer or reference (MSL kernels here call functions directly)"),
    ("derived class", re.compile(r"(?<!enum\s)\b(?:struct|class)\s+\w+\s*(?:final\s*)?:(?!:)"),
     "derived class (MSL has none)"),
]
_FLOAT_LITERAL = re.compile(r"(?<![\w.])(?:\d+\.\d*|\.\d+|\d+(?=[eE]))(?:[eE][+-]?\d+)?([fFhHlL]?)(?![\w.])")
_DELETED = re.compile(r"=\s*delete\b")  # a deleted function is C++14 that MSL keeps
_NOT_CALLS = {"if", "for", "while", "switch", "return", "sizeof", "alignof", "decltype", "catch",
              "static_assert", "defined", "template", "operator"}


def _text_problems(masked: str, origins: list[tuple[str, int]]) -> list[Problem]:
    probs = []
    lines = masked.split("\n")
    for i, text in enumerate(lines):
        f, ln = origins[i] if i < len(origins) else ("<unknown>", 0)
        if not _is_user(f) or ln == 0:
            continue
        code = _DELETED.sub("", text)
        for rule, rx, msg in _TEXT_RULES:
            if rx.search(code):
                probs.append(Problem(_display(f), ln, rule, msg))
        for fm in _FLOAT_LITERAL.finditer(code):
            if fm.group(1) in ("", "l", "L"):
                lit = fm.group(0).rstrip("lL")
                what = "is a long double" if fm.group(1) else "without a suffix is a double"
                probs.append(Problem(_display(f), ln, "double",
                                     f"floating literal {fm.group(0)} {what}: write {lit}f (MSL has no double)"))
    probs += _text_recursion(masked, origins)
    return probs


# a call: an optional Class<args>:: qualifier, the name, optional explicit template arguments
_CALL = re.compile(r"(?:\b\w+\s*<(?P<qargs>[^;{}()]*)>\s*::\s*)?"
                   r"\b(?P<name>[A-Za-z_]\w*)\s*(?:<(?P<args>[^;{}()]*)>)?\s*\(")
_COMPILE_TIME_STEP = re.compile(r"[-+*/%]|<<|>>")


def _text_recursion(masked: str, origins) -> list[Problem]:
    """Function definitions in user code and the names each body calls; a cycle is recursion."""
    line_at = [0]
    for ch_i, ch in enumerate(masked):
        if ch == "\n":
            line_at.append(ch_i + 1)

    def origin(off):
        lo, hi = 0, len(line_at) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if line_at[mid] <= off:
                lo = mid
            else:
                hi = mid - 1
        return origins[lo] if lo < len(origins) else ("<unknown>", 0)

    bodies: dict[str, list[tuple[int, int]]] = {}
    i, n = 0, len(masked)
    while i < n:
        if masked[i] != "{":
            i += 1
            continue
        # a function body: `name(...) [const|noexcept|...] {`
        j = i - 1
        while j >= 0 and (masked[j].isspace() or masked[j].isalnum() or masked[j] == "_"):
            if masked[j].isalnum() or masked[j] == "_":
                k = j
                while k >= 0 and (masked[k].isalnum() or masked[k] == "_"):
                    k -= 1
                if masked[k + 1:j + 1] not in ("const", "noexcept", "override", "final", "volatile"):
                    break
                j = k
            else:
                j -= 1
        end = _match_brace(masked, i)
        if j >= 0 and masked[j] == ")":
            lp = _match_back(masked, j)
            nm = re.search(r"([A-Za-z_]\w*)\s*(?:<[^;{}()]*>)?\s*$", masked[:lp])
            if nm and nm.group(1) not in _NOT_CALLS and _is_user(origin(i)[0]):
                bodies.setdefault(nm.group(1), []).append((i, end))
                i = end + 1
                continue
        i += 1
    graph: dict[str, dict[str, tuple[str, int]]] = {}
    for name, spans in bodies.items():
        for a, b in spans:
            for cm in _CALL.finditer(masked[a:b]):
                callee = cm.group("name")
                targs = (cm.group("qargs") or "") + (cm.group("args") or "")
                if _COMPILE_TIME_STEP.search(targs):
                    continue  # h<N - 1>(x), P<N - 1>::go(x): recursion over template arguments ends at compile time
                if callee in bodies and callee not in _NOT_CALLS:
                    graph.setdefault(name, {}).setdefault(callee, origin(a + cm.start()))
    probs = []
    for cycle in _cycles(graph):
        f, ln = graph[cycle[0]][(cycle[1:] + cycle[:1])[0]]
        chain = " -> ".join(cycle + [cycle[0]])
        probs.append(Problem(_display(f), ln, "recursion",
                             f"recursive call {chain} (MSL has no recursion; found by name, without clang)"))
    return probs


def _match_brace(s: str, i: int) -> int:
    # mslsim's bracket matcher; an unclosed body (code the compiler never saw) runs to the end
    t = _transform()
    try:
        return t.match_close(s, i)
    except t.MslsimError:
        return len(s) - 1


def _match_back(s: str, j: int) -> int:
    depth = 0
    for k in range(j, -1, -1):
        if s[k] == ")":
            depth += 1
        elif s[k] == "(":
            depth -= 1
            if depth == 0:
                return k
    return 0


# ------------------------------------------------------------------------------------------------
# the check
# ------------------------------------------------------------------------------------------------
def check(path, *, compiler: Compiler | None = None, mode: str = "auto", include_dirs=None) -> list[Problem]:
    """Problems of one .metal file (empty: it is valid MSL as far as this check sees).

    mode: "ast" (clang's AST; needs clang), "text" (token checks, any compiler) or "auto" (ast
    where the compiler is clang)."""
    path = Path(path)
    shown = _display(str(path))
    try:
        declared = declared_version(path)
    except VersionError as e:
        return [Problem(e.file, 1, "version", e.message)]
    compiler = compiler or find_compiler()
    if compiler is None:
        raise DialectError("no C++ compiler found (clang++ or g++; or set MSL_DIALECT_CXX)")
    if mode == "auto":
        mode = "ast" if compiler.is_clang else "text"
    if mode == "ast" and not compiler.is_clang:
        raise DialectError(f"mode 'ast' needs clang, not {compiler.path}")
    probs = []
    for major, minor in checked_versions(path, declared):
        for p in _check_at(path, shown, major, minor, compiler, mode, include_dirs):
            if (major, minor) != declared:  # say which pass found it: the bf16 blocks are in only here
                p = Problem(p.file, p.line, p.rule, f"{p.message} (checked as MSL {major}.{minor}, KRNL_BF16 on)")
            probs.append(p)
    seen, out = set(), []
    for p in probs:
        key = (p.file, p.line, p.rule, p.message if p.rule == "compile" else "")
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _check_at(path, shown, major, minor, compiler, mode, include_dirs) -> list[Problem]:
    """check() at one MSL version."""
    tr = _transform()
    dirs = [Path(d) for d in (include_dirs if include_dirs is not None else DEFAULT_INCLUDE_DIRS)]
    target = CLANG_FLAGS if compiler.is_clang else GCC_FLAGS
    # __METAL_VERSION__ as Apple's compiler sets it (3.1 -> 310); __METAL_MACOS__ for the platform.
    defs = [f"-D__METAL_VERSION__={major * 100 + minor * 10}", "-D__METAL_MACOS__"]
    pre = subprocess.run([compiler.path, "-E", "-x", "c++", "-std=c++14", "-nostdinc", "-nostdinc++", *target,
                          f"-isystem{INCLUDE}", *[f"-I{d}" for d in dirs], *defs, str(path)],
                         capture_output=True, text=True)
    if pre.returncode:
        return _compile_problems(pre.stderr, shown) or [Problem(shown, 1, "compile", pre.stderr.strip())]
    origins = _line_origins(pre.stdout)
    user_files = sorted({f for f, _ in origins if _is_user(f) and Path(f).is_file()})
    probs = _check_attributes(user_files, tr)
    code = _rewrite(pre.stdout, tr)
    # preprocessed input: its line markers carry the original files and lines (and the header's
    # system-header flag), and nothing is expanded twice
    cmd = [compiler.path, "-x", "c++-cpp-output", *COMMON_FLAGS, *target, "-"]
    if mode == "ast":
        cmd[1:1] = ["-Xclang", "-ast-dump=json"]
    r = subprocess.run(cmd, input=code, capture_output=True, text=True)
    probs += _compile_problems(r.stderr, shown)
    if mode == "ast":
        try:
            tree = json.loads(r.stdout)
        except json.JSONDecodeError:
            tree = None
        if tree is not None:
            raw = code.encode()
            starts = [0] + [m.end() for m in re.finditer(b"\n", raw)]

            def spelling(loc):  # a token's text, for messages
                off, n = loc.get("offset"), loc.get("tokLen")
                return raw[off:off + n].decode(errors="replace") if loc.get("_file") and off is not None and n else ""

            probs += _ast_problems(tree, lambda off: origins[bisect.bisect_right(starts, off) - 1], spelling)
        elif not r.returncode:
            raise DialectError(f"{shown}: clang printed no AST")
    else:
        probs += _text_problems(tr.mask(code), origins)
    return probs


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="default: every metal/*.metal")
    ap.add_argument("--cxx", help="compiler (default: clang++, else g++)")
    ap.add_argument("--mode", choices=("auto", "ast", "text"), default="auto")
    ap.add_argument("--msl-version", metavar="FILE", help="print the MSL version FILE declares and exit")
    a = ap.parse_args(argv)
    try:
        if a.msl_version:
            print("%d.%d" % declared_version(a.msl_version))
            return 0
        compiler = None
        if a.cxx:
            p = shutil.which(a.cxx) or a.cxx
            compiler = Compiler(p, _is_clang(p))
        files = a.files or sorted(str(p) for p in (REPO / "metal").glob("*.metal"))
        bad = 0
        for f in files:
            probs = check(f, compiler=compiler, mode=a.mode)
            for p in probs:
                print(p)
            bad += bool(probs)
    except DialectError as e:
        print(f"msl_dialect: {e}", file=sys.stderr)
        return 2
    print(f"msl_dialect: {len(files) - bad} of {len(files)} files pass", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
