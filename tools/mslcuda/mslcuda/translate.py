"""Preprocessed MSL -> CUDA for include/mslcuda.h: the rewrite step of mslcuda.

Shares mslsim's parsing helpers (tools/mslsim/mslsim/transform.py: masking of comments and
literals, bracket matching, kernel parameter attributes). Every edit keeps the newline count, so
nvcc's errors and compute-sanitizer's reports point at the .metal line. The rewrite:

  - function constants become `static constexpr` values of this build;
  - every function at namespace or class scope gets `__device__` (kernels too: each
    [[host_name]] kernel gets a `__global__` wrapper, msl_<host name>, that binds the dispatch's
    buffers and builtins to its parameters);
  - threadgroup variables become `__shared__`, program-scope `constant` variables constexpr
    scalars or `__constant__` arrays; other address spaces and MSL attributes go;
  - `1.0h` becomes half(1.0f), unsuffixed floating literals get `f` (MSL has no double);
  - `#pragma clang loop unroll(full)` becomes `#pragma unroll`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from mslsim.transform import (MslsimError, STD_ATTRIBUTES, _Edits, _parse_params, bake_function_constants, blank,
                              kernel_instantiations, mask, match_close, string_literals,
                              threadgroup_declarations)


class MslcudaError(MslsimError):
    pass


@dataclass
class Translated:
    code: str
    kernels: dict[str, str] = field(default_factory=dict)  # host name -> callee expression
    function_constants: dict[str, tuple[str, int, bool]] = field(default_factory=dict)


def _keep_lines(old: str, rep: str) -> str:
    return rep + "\n" * (old.count("\n") - rep.count("\n"))


def _decl_start(m: str, a: int, b: int) -> int:
    """First character of the declaration in m[a:b] after any `template <...>` headers."""
    i = a
    while True:
        while i < b and m[i].isspace():
            i += 1
        t = re.match(r"template\s*<", m[i:b])
        if not t:
            return i
        i = match_close(m, i + t.end() - 1) + 1


_FUNC_DECL = re.compile(r"[\w:<>,*&\s]*?\b[A-Za-z_]\w*\s*(?:<[^;{}]*>)?\s*\([^;{}]*\)\s*(?:const\s*)?$", re.S)
_NOT_FUNC = re.compile(r"^\s*(?:typedef|using|static_assert|return|friend|decltype)\b|^\s*template\s*[^<\s]|=")


def _scopes(m: str, ed: _Edits, text: str):
    """Adds `__device__` to every function declared or defined at namespace or class scope and
    rewrites program-scope `constant` variables; skips function bodies and other blocks."""
    stack = ["ns"]
    seg = 0
    i, n = 0, len(m)
    while i < n:
        c = m[i]
        if c == "(":
            i = match_close(m, i) + 1
            continue
        if c == "{":
            s = m[seg:i]
            st = s.strip()
            if re.search(r"\bnamespace\b", st) and "(" not in st:
                stack.append("ns")
                seg = i + 1
            elif re.search(r"\b(?:struct|class|union)\b", st) and not st.endswith(")") and "=" not in st:
                stack.append("class")
                seg = i + 1
            else:
                ds = _decl_start(m, seg, i)  # judged after any template header (`typename Y = T`)
                decl = m[ds:i].strip()
                func = (not re.search(r"\benum\b", decl) and "=" not in decl.replace("==", "") and
                        re.search(r"\)\s*(?:const\s*|noexcept\s*|mutable\s*)*$|\)\s*:\s*[^{};]*$", decl))
                if func:
                    ed.add(ds, ds, "__device__ ")
                i = match_close(m, i) + 1
                if func:  # a body ends its declaration; an initialiser or enum list runs on to its `;`
                    seg = i
                continue
        elif c == "}":
            stack.pop()
            seg = i + 1
        elif c == ";":
            s = m[seg:i]
            ds = _decl_start(m, seg, i)
            spec = re.match(r"\s*((?:\b(?:static|constexpr|const|constant|inline)\b\s*)+)", m[ds:i])
            if spec and re.search(r"\bconstant\b", spec.group(1)) and not ed.covered(ds + spec.start(1), ds + spec.end(1)):
                rest = m[ds + spec.end():i]
                rep = "__constant__ const " if "[" in rest else "static constexpr "
                ed.add(ds + spec.start(1), ds + spec.end(1), _keep_lines(text[ds + spec.start(1):ds + spec.end(1)], rep))
            elif _FUNC_DECL.fullmatch(m[ds:i]) and not _NOT_FUNC.search(m[ds:i]) and not ed.covered(ds, i):
                ed.add(ds, ds, "__device__ ")
            seg = i + 1
        i += 1


def translate(text: str, constants: dict | None = None) -> Translated:
    """Rewrite preprocessed MSL `text` into a CUDA translation unit for mslcuda.h, with function
    constants (by name or index) baked in, a __global__ wrapper per host name and a launcher."""
    constants = dict(constants or {})
    # pragmas are blanked by mask(): rewrite them in the text first (same length or padded)
    text = re.sub(r"#pragma\s+clang\s+loop\s+unroll\s*\(\s*full\s*\)", lambda x: x.group(0)[:0] + "#pragma unroll", text)
    text = re.sub(r"#pragma\s+(?:clang|METAL)\b[^\n]*", "", text)
    m = mask(text)
    ed = _Edits()
    out = Translated("")

    # -- function constants
    fc_values = bake_function_constants(text, m, constants, ed, out.function_constants, MslcudaError)

    # -- kernel definitions: `kernel` goes (the scope pass makes them __device__ functions)
    defs = {}
    for km in re.finditer(r"(?:\bkernel|\[\[[^\]]*\bkernel\b[^\]]*\]\])\s+void\s+([A-Za-z_]\w*)\s*\(", m):
        name = km.group(1)
        lp = km.end() - 1
        rp = match_close(m, lp)
        params = _parse_params(text[lp + 1:rp], m[lp + 1:rp], fc_values)
        for p in params:
            if p.kind == "threadgroup":
                raise MslcudaError(f"kernel '{name}': [[threadgroup({p.index})]] parameters are not supported "
                                   "(dispatch records carry no threadgroup memory lengths)")
        defs[name] = params
        head = m[max(0, km.start() - 400):km.start()]
        if not re.search(r"\btemplate\s*<[^;{}]*>\s*$", head, re.S):
            hn = re.search(r"\[\[\s*host_name\s*\(([^)]*)\)\s*\]\]\s*$", text[max(0, km.start() - 400):km.start()])
            out.kernels[string_literals(hn.group(1)) if hn else name] = name

    # -- explicit instantiations: recorded, then blanked (the wrapper instantiates the callee)
    for a, b, host, callee in kernel_instantiations(m, text, defs, MslcudaError):
        out.kernels[host] = callee
        ed.add(a, b, blank(text[a:b]))

    # -- threadgroup variables declared at statement start -> __shared__
    for start, end, _ in threadgroup_declarations(m, MslcudaError):
        ed.add(start, end, "__shared__ ")

    # -- every function gets __device__; program-scope constants
    _scopes(m, ed, text)

    # -- attributes, address spaces, keywords, literals
    for am in re.finditer(r"\[\[(.*?)\]\]", m, re.S):
        if ed.covered(am.start(), am.end()):
            continue
        nm = re.match(r"\s*([\w:]+)", am.group(1))
        if nm and nm.group(1) in STD_ATTRIBUTES:
            continue
        ed.add(am.start(), am.end(), blank(text[am.start():am.end()]))
    for qm in re.finditer(r"\bconstant\s+const\b|\bconst\s+constant\b|\bconstant\b|\bdevice\b|\bthreadgroup\b|\bthread\b"
                          r"|\bkernel\b|\bray_data\b|\bobject_data\b", m):
        if ed.covered(qm.start(), qm.end()):
            continue
        word = qm.group(0)
        rep = "const" if word != "constant" and "const" in word.split() else ""
        if word == "constant":
            # `constant T& x` (a parameter or a local) reads as const; unless a const is already there
            before = m[max(0, qm.start() - 40):qm.start()]
            after = m[qm.end():qm.end() + 40]
            rep = "" if re.search(r"\bconst\s*$", before) or re.match(r"\s*const\b", after) else "const"
        ed.add(qm.start(), qm.end(), rep + " " * (len(word) - len(rep)) if len(rep) <= len(word) else rep)
    for hm in re.finditer(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b", m):
        if ed.covered(hm.start(), hm.end()):
            continue
        lit = hm.group(1)
        if not re.search(r"[.eE]", lit):
            lit += ".0"
        ed.add(hm.start(), hm.end(), f"half({lit}f)")
    for fm in re.finditer(r"(?<![\w.])(?:\d+\.\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)(?![\w.])", m):
        if not ed.covered(fm.start(), fm.end()):
            ed.add(fm.end(), fm.end(), "f")

    code = ed.apply(text)

    # -- wrappers and launcher
    if not out.kernels:
        raise MslcudaError("no kernel functions found")
    lines = ["", "// ---- kernel wrappers generated by mslcuda ----"]
    cases = []
    names = []
    for k, (host, callee) in enumerate(out.kernels.items()):
        if not re.fullmatch(r"[A-Za-z_]\w*", host):
            raise MslcudaError(f"host name '{host}' is not an identifier")
        params = defs[callee.split("<")[0].split("::")[-1]]
        args = []
        for p in params:
            if p.kind == "builtin":
                args.append(f"mslcuda::b_{p.index}()")
            elif p.kind == "absent":
                args.append("mslcuda::BufArg{nullptr}")
            else:
                args.append(f"mslcuda::buffer(lp, {p.index})")
        # through the address, as MSL's `decltype(f<...>) f<...>` names it: default template arguments
        # apply, and nothing is deduced from the converted arguments
        lines.append(f'extern "C" __global__ void __launch_bounds__(1024) msl_{host}(const __grid_constant__ '
                     f"mslcuda::LaunchParams lp) {{ auto* const f = &{callee}; f({', '.join(args)}); }}")
        cases.append(f"    case {k}: msl_{host}<<<g, b, 0, stream>>>(lp); break;")
        names.append(f'"{host}"')
    lines += [
        f"static const char* const mslcuda_names[] = {{{', '.join(names)}}};",
        f'extern "C" int mslcuda_kernel_count() {{ return {len(names)}; }}',
        'extern "C" const char* mslcuda_kernel_name(int i) { return mslcuda_names[i]; }',
        'extern "C" const char* mslcuda_launch(int k, const unsigned* grid, const unsigned* threads, void* const* bufs,',
        "                                      int nbuf, const void* args, unsigned args_len, unsigned args_index,",
        "                                      void* stream_) {",
        "  mslcuda::LaunchParams lp{};",
        "  if (nbuf > mslcuda::kMaxBuffers || args_len > unsigned(mslcuda::kMaxArgs)) return \"too many buffers or argument bytes\";",
        "  for (int i = 0; i < nbuf; ++i) lp.buf[i] = bufs[i];",
        "  lp.args_index = args_index;",
        "  memcpy(lp.args, args, args_len);",
        "  const dim3 g(grid[0], grid[1], grid[2]), b(threads[0], threads[1], threads[2]);",
        "  cudaStream_t stream = static_cast<cudaStream_t>(stream_);",
        "  switch (k) {",
        *cases,
        '    default: return "no such kernel";',
        "  }",
        "  const cudaError_t e = cudaGetLastError();",
        "  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);",
        "}",
    ]
    out.code = '#include "mslcuda.h"\n' + code + "\n".join(lines) + "\n"
    return out
