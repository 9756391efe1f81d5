"""MSL source -> C++ for the shim: the rewrite step of mslsim.

Works on preprocessed MSL text. mask() blanks comments, literals and line markers so that the
regexes below see only code, at unchanged offsets; all edits are collected first and applied
back to front, and every replacement keeps the newline count so that compiler errors and
barrier sites still point at the right .metal line.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

import numpy as np

# Builtin argument attributes the runtime can provide (mslsim_runtime.h, enum Builtin).
BUILTINS = {
    "thread_position_in_grid", "thread_position_in_threadgroup", "threadgroup_position_in_grid",
    "threadgroups_per_grid", "threads_per_threadgroup", "dispatch_threads_per_threadgroup", "threads_per_grid",
    "thread_index_in_threadgroup", "thread_index_in_simdgroup", "simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup", "dispatch_simdgroups_per_threadgroup", "threads_per_simdgroup",
    "thread_execution_width", "thread_index_in_quadgroup", "quadgroup_index_in_threadgroup",
    "quadgroups_per_threadgroup", "dispatch_quadgroups_per_threadgroup",
}
# C++ attributes that g++ understands: kept, every other [[...]] is MSL-only and blanked.
STD_ATTRIBUTES = {"likely", "unlikely", "maybe_unused", "fallthrough", "nodiscard", "noreturn", "deprecated"}


class MslsimError(RuntimeError):
    pass


def mask(text: str) -> str:
    """Blank out string/char literals, comments and preprocessor lines (newlines are kept), so that
    regexes only see code.  Positions are unchanged."""
    out = list(text)
    i, n = 0, len(text)
    line_start = True

    def blank_to_eol(i):
        j = text.find("\n", i)
        j = n if j < 0 else j
        out[i:j] = " " * (j - i)
        return j

    while i < n:
        c = text[i]
        if c == "\n":
            line_start = True
            i += 1
            continue
        if line_start and c == "#":
            i = blank_to_eol(i)
            continue
        if c not in " \t":
            line_start = False
        if c == "/" and text.startswith("//", i):
            i = blank_to_eol(i)
            continue
        if c == "/" and text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
            continue
        if c == '"' or (c == "'" and not (i > 0 and text[i - 1].isalnum())):
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            for k in range(i, min(j + 1, n)):
                if out[k] != "\n":
                    out[k] = " "
            # keep the quotes so that token boundaries survive
            out[i] = c
            if j < n:
                out[j] = c
            i = j + 1
            continue
        i += 1
    return "".join(out)


def match_close(s: str, i: int) -> int:
    """s[i] is an opening bracket; return the index of its partner (angle brackets only nest <>)."""
    pairs = {"(": ")", "[": "]", "{": "}", "<": ">"}
    opener, closer = s[i], pairs[s[i]]
    depth = 0
    for j in range(i, len(s)):
        if s[j] == opener:
            depth += 1
        elif s[j] == closer:
            depth -= 1
            if depth == 0:
                return j
    raise MslsimError(f"unbalanced '{opener}' at offset {i}")


def split_top(s: str, sep: str = ",") -> list[tuple[int, int]]:
    """Spans of s split at top-level separators (ignoring (), [], {}, <>)."""
    spans, depth, start = [], 0, 0
    for j, c in enumerate(s):
        if c in "([{<":
            depth += 1
        elif c in ")]}>":
            depth -= 1
        elif c == sep and depth == 0:
            spans.append((start, j))
            start = j + 1
    spans.append((start, len(s)))
    return spans


def blank(s: str) -> str:
    return "".join("\n" if c == "\n" else " " for c in s)


def safe_int(expr: str) -> int:
    node = ast.parse(expr.strip().rstrip("uUlL"), mode="eval")

    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.LShift)):
            a, b = ev(n.left), ev(n.right)
            return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b, ast.FloorDiv: a // b, ast.LShift: a << b}[type(n.op)]
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        raise MslsimError(f"cannot evaluate index expression '{expr}'")

    return ev(node)


def string_literals(s: str) -> str:
    return "".join(m.group(1) for m in re.finditer(r'"((?:[^"\\]|\\.)*)"', s))


# ------------------------------------------------------------------------------------------------
# transform
# ------------------------------------------------------------------------------------------------
@dataclass
class Param:
    name: str
    kind: str          # buffer | threadgroup | builtin | absent
    index: int | str   # buffer/threadgroup index, or builtin name
    fc: str | None = None


@dataclass
class KernelDef:
    name: str
    params: list[Param]
    is_template: bool


@dataclass
class Transformed:
    code: str
    kernels: dict[str, str] = field(default_factory=dict)          # host name -> callee expression
    function_constants: dict[str, tuple[str, int, bool]] = field(default_factory=dict)  # name -> (type, index, defined)


class _Edits:
    def __init__(self):
        self.items: list[tuple[int, int, str]] = []

    def add(self, a: int, b: int, rep: str):
        self.items.append((a, b, rep))

    def covered(self, a: int, b: int) -> bool:
        return any(x < b and a < y for x, y, _ in self.items)

    def apply(self, text: str) -> str:
        for a, b, rep in sorted(self.items, reverse=True):
            text = text[:a] + rep + text[b:]
        return text


def kernel_instantiations(m: str, text: str, defs, error=MslsimError):
    """The explicit kernel instantiations of a file, `template [[host_name("x")]] [[kernel]] void
    f<T>(...);` or `... decltype(f<T>) f<T>;`: (start, end, host name, callee f<T>) per statement,
    from its masked text m (comments and literals blanked) and the original text; defs holds the
    kernel templates defined. `error` is raised for a statement that cannot be parsed."""
    for tm in re.finditer(r"\btemplate\b", m):
        j = tm.end()
        while j < len(m) and m[j].isspace():
            j += 1
        if j < len(m) and m[j] == "<":
            continue
        end = j
        depth = 0
        while end < len(m) and not (m[end] == ";" and depth == 0):
            if m[end] in "([{":
                depth += 1
            elif m[end] in ")]}":
                depth -= 1
            end += 1
        stmt_m, stmt_o = m[tm.start():end], text[tm.start():end]
        hn = re.search(r"host_name\s*\((.*?)\)\s*\]\]", stmt_o, re.S)
        if not hn and not re.search(r"\bkernel\b|\[\[\s*kernel\s*\]\]", stmt_m):
            continue
        s2 = re.sub(r"\[\[.*?\]\]", lambda x: blank(x.group(0)), stmt_m, flags=re.S)
        s2 = re.sub(r"\bdecltype\s*\(", lambda x: blank(x.group(0)), s2)
        callee = None
        for cm in re.finditer(r"([A-Za-z_][\w:]*)\s*<", s2):
            if cm.group(1) in ("template", "decltype"):
                continue
            lt = cm.end() - 1
            try:
                gt = match_close(s2, lt)
            except MslsimError:
                continue
            rest = s2[gt + 1:].lstrip()
            if rest.startswith("(") or rest == "" or rest.startswith(";"):
                callee = (cm.group(1) + stmt_o[lt:gt + 1]).strip()
                break
        if callee is None:
            raise error(f"cannot parse kernel instantiation: {stmt_o.strip()[:200]}")
        base = callee.split("<")[0].split("::")[-1]
        if base not in defs:
            raise error(f"instantiation of unknown kernel template '{base}'")
        yield tm.start(), end + 1, string_literals(hn.group(1)) if hn else callee, callee


def threadgroup_declarations(m: str, error=MslsimError):
    """The threadgroup variables declared at statement start in masked text m (not pointers,
    references, parameters or initialised ones): (start and end of the keyword `threadgroup`, the
    statement's `;`) each. Several variables in one statement raise `error`: stripping
    `threadgroup` would silently make them per-thread variables."""
    for gm in re.finditer(r"\bthreadgroup\b", m):
        k = gm.start() - 1
        while k >= 0 and m[k].isspace():
            k -= 1
        if k >= 0 and m[k] not in ";{}":
            continue
        semi = m.find(";", gm.end())
        stmt = m[gm.end():semi]
        nodims = re.sub(r"\[[^\]]*\]", "", stmt)
        if re.search(r"[*&(=]", nodims):
            continue
        if len(split_top(nodims)) > 1:
            raise error(f"declare one threadgroup variable per statement: 'threadgroup{stmt.strip()}'"[:300])
        yield gm.start(), gm.end(), semi


def _parse_params(orig: str, m: str, fc_values: dict[str, bool]) -> list[Param]:
    params: list[Param] = []
    if not m.strip() or m.strip() == "void":
        return params
    pending_auto: list[Param] = []
    used: set[int] = set()
    for a, b in split_top(m):
        pm, po = m[a:b], orig[a:b]
        attrs: list[str] = []
        for am in re.finditer(r"\[\[(.*?)\]\]", pm, re.S):
            inner = po[am.start(1):am.end(1)]
            attrs += [inner[x:y].strip() for x, y in split_top(inner)]
        decl = re.sub(r"\[\[.*?\]\]", " ", pm, flags=re.S).strip()
        nm = re.search(r"([A-Za-z_]\w*)\s*$", decl)
        name = nm.group(1) if nm else f"arg{len(params)}"
        p = Param(name, "buffer", -1)
        for at in attrs:
            am = re.fullmatch(r"(\w+)\s*(?:\((.*)\))?", at, re.S)
            if not am:
                continue
            key, arg = am.group(1), am.group(2)
            if key == "buffer":
                p.kind, p.index = "buffer", safe_int(arg)
            elif key == "threadgroup":
                p.kind, p.index = "threadgroup", safe_int(arg)
            elif key == "function_constant":
                p.fc = arg.strip()
            elif key in BUILTINS:
                p.kind, p.index = "builtin", key
            elif key in ("texture", "sampler", "stage_in", "visible_function_table", "intersection_function_table",
                         "instance_acceleration_structure", "primitive_acceleration_structure"):
                raise MslsimError(f"parameter '{name}': [[{key}]] is not supported by the CPU emulation")
            elif key in ("id", "raster_order_group", "user"):
                pass
            else:
                raise MslsimError(f"parameter '{name}': unknown attribute [[{at}]]")
        if p.kind == "buffer":
            if p.index == -1:
                pending_auto.append(p)
            else:
                used.add(p.index)
        if p.fc is not None:
            if p.fc not in fc_values:
                raise MslsimError(f"parameter '{name}': [[function_constant({p.fc})]] names no declared function constant")
            if not fc_values[p.fc]:
                p.kind = "absent"
        params.append(p)
    nxt = 0
    for p in pending_auto:  # parameters without attributes get the lowest free buffer indices
        while nxt in used:
            nxt += 1
        p.index = nxt
        used.add(nxt)
    return params


def _literal(ctype: str, value) -> str:
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        return f"{ctype}({int(value)})"
    if isinstance(value, (float, np.floating)):
        return f"{ctype}({float(value)!r})"
    raise MslsimError(f"unsupported function constant value {value!r}")


def bake_function_constants(text: str, m: str, constants: dict, ed, declared: dict, error=MslsimError):
    """Queues on `ed` the rewrite of each `constant T name [[function_constant(i)]];` into a
    constexpr with its value from `constants` (by name or index; unset: T()) and of each
    is_function_constant_defined(name) into true/false; fills declared {name: (type, index,
    defined)}. Returns {name: truth value} (an unset constant is false), for the parameters that
    take [[function_constant(name)]]. Lines are kept (errors point at the .metal line)."""
    fc_values: dict[str, bool] = {}
    used = set()
    for fm in re.finditer(r"\bconstant\s+([A-Za-z_][\w:<>, ]*?)\s+([A-Za-z_]\w*)\s*\[\[\s*function_constant\s*\((.*?)\)\s*\]\]\s*;",
                          m, re.S):
        ctype, name = fm.group(1).strip(), fm.group(2)
        idx = safe_int(text[fm.start(3):fm.end(3)])
        key = name if name in constants else idx if idx in constants else None
        if key is not None:
            used.add(key)
            rep = f"static constexpr {ctype} {name} = {_literal(ctype, constants[key])};"
            fc_values[name] = bool(constants[key]) if ctype == "bool" else True
        else:
            rep = f"static constexpr {ctype} {name} = {ctype}();"
            fc_values[name] = False
        declared[name] = (ctype, idx, key is not None)
        ed.add(fm.start(), fm.end(), rep + "\n" * text[fm.start():fm.end()].count("\n"))
    unknown = set(constants) - used
    if unknown:
        raise error(f"function constants {sorted(map(str, unknown))} are not declared in the source")
    for dm in re.finditer(r"\bis_function_constant_defined\s*\(\s*(\w+)\s*\)", m):
        name = dm.group(1)
        if name not in declared:
            raise error(f"is_function_constant_defined({name}): no such function constant")
        ed.add(dm.start(), dm.end(), "true" if declared[name][2] else "false")
    return fc_values


def transform(text: str, constants: dict | None = None) -> Transformed:
    """Rewrite preprocessed MSL `text` into a C++ translation unit for the shim, with function
    constants (by name or index) baked in as constexpr values and a registry of host names."""
    constants = dict(constants or {})
    m = mask(text)
    ed = _Edits()
    out = Transformed("")

    # -- function constants: `constant T name [[function_constant(i)]];` -> constexpr with the value
    fc_values = bake_function_constants(text, m, constants, ed, out.function_constants)

    # -- kernel definitions
    defs: dict[str, KernelDef] = {}
    for km in re.finditer(r"(?:\bkernel|\[\[[^\]]*\bkernel\b[^\]]*\]\])\s+void\s+([A-Za-z_]\w*)\s*\(", m):
        name = km.group(1)
        lp = km.end() - 1
        rp = match_close(m, lp)
        params = _parse_params(text[lp + 1:rp], m[lp + 1:rp], fc_values)
        head = m[max(0, km.start() - 400):km.start()]
        is_template = bool(re.search(r"\btemplate\s*<[^;{}]*>\s*$", head, re.S))
        if name in defs and [p.__dict__ for p in defs[name].params] != [p.__dict__ for p in params]:
            raise MslsimError(f"kernel '{name}' is declared twice with different parameters")
        defs[name] = KernelDef(name, params, is_template)
        if not is_template:
            # `[[host_name("x")]] kernel void f(...)` is dispatched as "x", as on Metal
            hn = re.search(r"\[\[\s*host_name\s*\(([^)]*)\)\s*\]\]\s*$", text[max(0, km.start() - 400):km.start()])
            out.kernels[string_literals(hn.group(1)) if hn else name] = name

    # -- explicit instantiations: template [[host_name("x")]] [[kernel]] void f<T>(...);  / decltype(f<T>) f<T>;
    for a, b, host, callee in kernel_instantiations(m, text, defs):
        out.kernels[host] = callee
        ed.add(a, b, blank(text[a:b]))

    # -- threadgroup variables declared in a kernel body -> per-threadgroup shared storage
    uid = 0
    for start, end, semi in threadgroup_declarations(m):
        stmt = m[end:semi]
        dm = re.fullmatch(r"\s*(.+?)\s+([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)", stmt, re.S)
        if not dm:
            continue
        orig = text[end:semi]
        ctype = orig[dm.start(1):dm.end(1)].strip()
        dims = re.sub(r"\s+", "", orig[dm.start(3):dm.end(3)])
        uid += 1
        rep = f"auto& {dm.group(2)} = ::mslsim::rt::tg_var<{ctype}{dims}>({uid});"
        rep += "\n" * text[start:semi + 1].count("\n")
        ed.add(start, semi + 1, rep)

    # -- attributes, address spaces, keywords, half literals
    for am in re.finditer(r"\[\[(.*?)\]\]", m, re.S):
        if ed.covered(am.start(), am.end()):
            continue
        name = re.match(r"\s*([\w:]+)", am.group(1))
        if name and name.group(1) in STD_ATTRIBUTES:
            continue
        ed.add(am.start(), am.end(), blank(text[am.start():am.end()]))
    spec_run = re.compile(r"(?:\b(?:static|constexpr|const|volatile|inline|constant|thread_local)\b\s*)+")
    for qm in re.finditer(r"\bconstant\s+const\b|\bconst\s+constant\b|\bconstant\b|\bdevice\b|\bthreadgroup\b|\bthread\b|\bkernel\b", m):
        if ed.covered(qm.start(), qm.end()):
            continue
        word = qm.group(0)
        rep = "const" if "const" in word and word != "kernel" else ""
        if word in ("device", "threadgroup", "thread", "kernel"):
            rep = ""
        if word == "constant":
            # `static constant constexpr const T x` -> only one const survives
            a = qm.start()
            while a > 0 and (m[a - 1].isalnum() or m[a - 1] in "_ \t\n"):
                a -= 1
            run = spec_run.search(m, a)
            if run and run.start() <= qm.start() and re.search(r"\bconst\b", m[run.start():run.end()]):
                rep = ""
        ed.add(qm.start(), qm.end(), rep + blank(word)[len(rep):])
    for hm in re.finditer(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b", m):
        if ed.covered(hm.start(), hm.end()):
            continue
        lit = hm.group(1)
        if not re.search(r"[.eE]", lit):
            lit += ".0"
        ed.add(hm.start(), hm.end(), f"half({lit}f)")

    code = ed.apply(text)

    # -- registry
    reg = ["", "// ---- kernel registry generated by mslsim ----"]
    entries = []
    for i, (host, callee) in enumerate(out.kernels.items()):
        base = callee.split("<")[0].split("::")[-1]
        kd = defs[base]
        kinds = []
        for p in kd.params:
            if p.kind == "builtin":
                kinds.append(f"{{::mslsim::rt::P_BUILTIN, ::mslsim::rt::B_{p.index}, \"{p.name}\"}}")
            elif p.kind == "absent":
                kinds.append(f"{{::mslsim::rt::P_ABSENT, 0, \"{p.name}\"}}")
            elif p.kind == "threadgroup":
                kinds.append(f"{{::mslsim::rt::P_THREADGROUP, {p.index}, \"{p.name}\"}}")
            else:
                kinds.append(f"{{::mslsim::rt::P_BUFFER, {p.index}, \"{p.name}\"}}")
        arr = ", ".join(kinds) if kinds else "{0, 0, nullptr}"
        reg.append(f"static const ::mslsim::rt::ParamDesc __mslsim_params_{i}[] = {{{arr}}};")
        reg.append(f"static_assert(::mslsim::rt::Invoker<&{callee}>::arity == {len(kd.params)}, "
                   f"\"mslsim: parameter count mismatch for {host}\");")
        entries.append(f"  {{\"{host}\", &::mslsim::rt::Invoker<&{callee}>::run, __mslsim_params_{i}, {len(kd.params)}}},")
    if not entries:
        raise MslsimError("no kernel functions found")
    reg.append("static const ::mslsim::rt::KernelEntry __mslsim_kernels[] = {")
    reg += entries
    reg.append("};")
    reg.append("MSLSIM_REGISTRY(__mslsim_kernels)")
    out.code = '#include "mslsim.h"\n' + code + "\n".join(reg) + "\n"
    return out


