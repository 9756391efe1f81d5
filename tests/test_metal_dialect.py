"""metal/*.metal as MSL's dialect of C++14, checked without a Mac (tools/mslsim/dialect).

- Every kernel file passes the check: `-std=c++14 -fsyntax-only` against a C++14 declaration of the
  MSL it uses (include/msl14.h), then MSL's restrictions from clang's AST (recursion over the
  instantiated call graph, lambdas, virtual, new/delete, function pointers, double, goto, ...) and,
  as the fallback where clang is missing, from a token check of the preprocessed source. Both are
  run where they can be.
- Known to bite: a small kernel with one planted violation per forbidden construct (and copies of
  real kernels with one) must be rejected with the file and the planted line.
- The MSL version each file declares on its first line (`// msl: X.Y`) is one the check covers;
  bfloat users declare >= 3.1; the binary's library_msl_version agrees with the files.
Skips only where no C++ compiler exists at all (the AST checks: where clang++ is missing); in CI
(CI=true) nothing here may skip."""
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
METAL = ROOT / "metal"
KERNELS = sorted(METAL.glob("*.metal"))
sys.path.insert(0, str(ROOT / "tools" / "mslsim" / "dialect"))
import msl_dialect as md  # noqa: E402

IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
CLANG = md.find_compiler("clang")
GCC = md.find_compiler("gcc")
ANY = CLANG or GCC
NO_COMPILER = "no C++ compiler (clang++ or g++) on PATH: the MSL dialect check cannot run at all"


def _require(compiler, why):
    if compiler is None:
        if IN_CI:
            pytest.fail(why + " (CI must run every check: install clang)")
        pytest.skip(why)
    return compiler


def _compiler(mode):
    # the AST checks need clang; the text fallback runs with g++ where it exists, as it would on a
    # machine without clang
    if mode == "ast":
        return _require(CLANG, "no clang++ on PATH: the AST checks (recursion over the call graph, function "
                               "pointers, double types) need clang; the text-fallback tests still run")
    return _require(GCC or CLANG, NO_COMPILER)


# ------------------------------------------------------------------------------------------------
# the kernels pass
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["ast", "text"])
@pytest.mark.parametrize("path", KERNELS, ids=[p.stem for p in KERNELS])
def test_kernel_is_msl_dialect(path, mode):
    probs = md.check(path, compiler=_compiler(mode), mode=mode)
    assert not probs, f"{path.name} is not valid MSL 3.x here:\n" + "\n".join(map(str, probs))


# ------------------------------------------------------------------------------------------------
# known to bite: planted violations
# ------------------------------------------------------------------------------------------------
KERNEL = """\
// msl: {version}
#include <metal_stdlib>
#include "kargs.h"
using namespace metal;

{body}

kernel void planted(device float* x [[buffer(0)]], constant ElementwiseArgs& args [[buffer(1)]],
                    uint gid [[thread_position_in_grid]])
{{
    if (gid < args.n) x[gid] = f(x[gid]);
}}
"""

# name -> (rules that may report it, body); `//!` marks each line where the violation may be reported
PLANTED = {
    "recursion": ({"recursion"}, "float f(float v) { return v > 1.0f ? f(v * 0.5f) : v; }  //!"),
    "mutual recursion": ({"recursion"}, "float g(float v);\n"
                                        "float f(float v) { return v > 1.0f ? g(v) : v; }  //!\n"
                                        "float g(float v) { return f(v * 0.5f); }  //!"),
    "template recursion": ({"recursion"}, "template <typename T>\n"
                                          "T h(T v) { return v > T(1) ? h(v * T(0.5f)) : v; }  //!\n"
                                          "float f(float v) { return h(v); }"),
    "throw": ({"compile", "exceptions"}, "float f(float v) {\n  if (v < 0.0f) throw 1;  //!\n  return v;\n}"),
    "try": ({"compile", "exceptions"}, "float f(float v) {\n  try { return v; } catch (...) { return 0.0f; }  //!\n}"),
    "virtual": ({"virtual"}, "struct S { virtual float get(float v) const { return v; } };  //!\n"
                             "float f(float v) { S s; return s.get(v); }"),
    "new": ({"new/delete"}, "float f(float v) {\n  float* p = new float(v);  //!\n  return *p;\n}"),
    "delete": ({"new/delete"}, "float f(float v) {\n  float* p = &v;\n  delete p;  //!\n  return v;\n}"),
    "function pointer": ({"function pointer"}, "float sq(float v) { return v * v; }\n"
                                               "float f(float v) {\n  float (*fp)(float) = sq;  //!\n"
                                               "  return fp(v);\n}"),
    "function reference": ({"function pointer"}, "float sq(float v) { return v * v; }\n"
                                                 "float apply(float (&fn)(float), float v) { return fn(v); }  //!\n"
                                                 "float f(float v) { return apply(sq, v); }"),
    "double variable": ({"double"}, "float f(float v) {\n  double d = v;  //!\n  return float(d);\n}"),
    "double literal": ({"double"}, "float f(float v) {\n  return v * 0.5;  //!\n}"),
    "goto": ({"goto"}, "float f(float v) {\n  if (v < 0.0f) goto out;  //!\n  v = v * 2.0f;\nout:\n  return v;\n}"),
    "lambda with capture": ({"lambda"}, "float f(float v) {\n  auto g = [v](float a) { return a + v; };  //!\n"
                                        "  return g(v);\n}"),
    "lambda": ({"lambda"}, "float f(float v) {\n  auto g = [](float a) { return a * 2.0f; };  //!\n"
                           "  return g(v);\n}"),
    "derived class": ({"derived class"}, "struct A { float a; };\nstruct B : A { float b; };  //!\n"
                                         "float f(float v) { B s; s.a = v; return s.a; }"),
    "thread_local": ({"thread_local"}, "float f(float v) {\n  static thread_local float t = 0.0f;  //!\n"
                                       "  t += v;\n  return t;\n}"),
    "noexcept operator": ({"noexcept"}, "float f(float v) {\n  return noexcept(v + 1.0f) ? v : 0.0f;  //!\n}"),
    "typeid": ({"compile", "rtti"}, "float f(float v) {\n  return typeid(v) == typeid(v) ? v : 0.0f;  //!\n}"),
    "C++17": ({"compile"}, "float f(float v) {\n  if constexpr (sizeof(float) == 4) return v;  //!\n  return 0.0f;\n}"),
    "C++ standard library": ({"compile"}, "#include <cmath>  //!\nfloat f(float v) { return v; }"),
    "variable-length array": ({"compile"}, "float f(float v) {\n  int n = int(v);\n  float a[n];  //!\n"
                                           "  a[0] = v;\n  return a[0];\n}"),
    "unknown attribute": ({"attribute"}, "float f(float v) { return v; }\n"
                                         "kernel void k2(device float* y [[bufer(0)]]) { y[0] = 0.0f; }  //!"),
    "bfloat under MSL 3.0": ({"compile"}, "float f(float v) {\n  bfloat b = bfloat(v);  //!\n  return float(b);\n}"),
    "std:: call": ({"compile"}, "float f(float v) {\n  return std::sqrt(v);  //!\n}"),
}


def _plant(tmp_path, body, version="3.0", name="planted.metal"):
    text = KERNEL.format(version=version, body=body)
    lines = {i + 1 for i, ln in enumerate(text.splitlines()) if ln.rstrip().endswith("//!")}
    path = tmp_path / name
    path.write_text(text)
    return path, lines


def _assert_bites(path, probs, rules, lines):
    hits = [p for p in probs if Path(p.file).resolve() == path.resolve() and p.line in lines and p.rule in rules]
    assert hits, (f"the planted violation at {path.name}:{sorted(lines)} ({'/'.join(sorted(rules))}) was not "
                  f"reported; the check said:\n" + "\n".join(map(str, probs)))


@pytest.mark.parametrize("mode", ["ast", "text"])
@pytest.mark.parametrize("case", list(PLANTED))
def test_planted_violation_is_rejected(tmp_path, case, mode):
    rules, body = PLANTED[case]
    path, lines = _plant(tmp_path, body)
    _assert_bites(path, md.check(path, compiler=_compiler(mode), mode=mode), rules, lines)


@pytest.mark.parametrize("mode", ["ast", "text"])
def test_recursion_in_a_real_kernel_is_rejected(tmp_path, mode):
    # gemm_tile calling itself: the call graph runs through the template instantiations
    # (gemm_plain<half, float, ...> -> gemm_tile<half, float, ...>) of the real file
    src = (METAL / "gemm.metal").read_text()
    anchor = "    threadgroup float* Cs = (threadgroup float*)smem;"
    assert anchor in src, "gemm.metal changed: update the planted line's anchor"
    planted = ("    if (kb > ke) gemm_tile<T, TC, TA, TB>(A, B, C, M, N, lda, ldb, ldc, ke, kb, alpha, beta, m0, n0, "
               "lane, smem, aligned);\n")
    i = src.index(anchor)
    i = src.index("\n", i) + 1
    path = tmp_path / "gemm.metal"
    path.write_text(src[:i] + planted + src[i:])
    line = src[:i].count("\n") + 1
    _assert_bites(path, md.check(path, compiler=_compiler(mode), mode=mode), {"recursion"}, {line})


@pytest.mark.parametrize("mode", ["ast", "text"])
def test_double_literal_in_a_real_kernel_is_rejected(tmp_path, mode):
    src = (METAL / "softmax.metal").read_text()
    good = "const float inv = 1.0f / total;"
    assert good in src, "softmax.metal changed: update the planted line"
    path = tmp_path / "softmax.metal"
    path.write_text(src.replace(good, "const float inv = 1.0 / total;"))
    line = src[:src.index(good)].count("\n") + 1
    probs = md.check(path, compiler=_compiler(mode), mode=mode)
    _assert_bites(path, probs, {"double"}, {line})
    assert any("1.0f" in p.message for p in probs if p.line == line), "the message should say what to write"


@pytest.mark.parametrize("mode", ["ast", "text"])
def test_msl_idioms_are_accepted(tmp_path, mode):
    # No false alarms on what MSL allows: compile-time recursion over template arguments, deleted
    # functions, enum classes with a base, half literals, bfloat under 3.1, attributes on the
    # explicit instantiation that names a kernel.
    body = ("template <int N> struct P { static float go(float v) { return P<N - 1>::go(v * 0.5f); } };\n"
            "template <> struct P<0> { static float go(float v) { return v; } };\n"
            "template <int N> float h(float v) { return h<N - 1>(v) * 2.0f; }\n"
            "template <> float h<0>(float v) { return v; }\n"
            "enum class E : int { a, b };\n"
            "struct NoCopy { NoCopy() = default; NoCopy(const NoCopy&) = delete; };\n"
            "float f(float v) {\n"
            "  bfloat b = bfloat(v);\n"
            "  return P<3>::go(v) + h<2>(v) + 1.5h + float(int(E::a)) + float(b);\n"
            "}\n"
            "template <typename T> kernel void t(device T* y [[buffer(0)]]) { y[0] = T(0); }\n"
            'template [[host_name("t_f32")]] [[kernel]] decltype(t<float>) t<float>;')
    path, _ = _plant(tmp_path, body, version="3.1")
    probs = md.check(path, compiler=_compiler(mode), mode=mode)
    assert not probs, "\n".join(map(str, probs))


# ------------------------------------------------------------------------------------------------
# MSL versions
# ------------------------------------------------------------------------------------------------
# A block the host compiles only as MSL 3.1, on GPUs with native bf16 (csrc/metal/device.mm).
BF16_BLOCK = re.compile(r"^#if KRNL_BF16\b.*?^#endif", re.S | re.M)


def _uses_bfloat(path):
    """Whether the file uses bfloat outside its `#if KRNL_BF16` blocks."""
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(), flags=re.S)
    return re.search(r"\bbfloat", BF16_BLOCK.sub("", code)) is not None


@pytest.mark.parametrize("path", KERNELS, ids=[p.stem for p in KERNELS])
def test_kernel_declares_its_msl_version(path):
    major, minor = md.declared_version(path)  # raises with the file and line when missing or unknown
    assert (major, minor) in md.SUPPORTED_VERSIONS
    if _uses_bfloat(path):
        assert (major, minor) >= (3, 1), f"{path.name} uses bfloat (MSL 3.1) but declares {major}.{minor}"


def test_bfloat_needs_msl_3_1(tmp_path):
    # the rule has teeth: the same kernel fails under 3.0 and passes under 3.1
    compiler = _require(ANY, NO_COMPILER)
    body = "float f(float v) {\n  bfloat b = bfloat(v);  //!\n  return float(b);\n}"
    path, lines = _plant(tmp_path, body, version="3.0")
    _assert_bites(path, md.check(path, compiler=compiler), {"compile"}, lines)
    path, _ = _plant(tmp_path, body, version="3.1")
    assert not md.check(path, compiler=compiler)


BF16_BODY = ("float f(float v) {{ return v; }}\n"
             "#if KRNL_BF16\n"
             "float g(float v) {{\n  bfloat b = bfloat(v);\n  return float(b){extra};  {mark}\n}}\n"
             "#endif")


@pytest.mark.parametrize("path", KERNELS, ids=[p.stem for p in KERNELS])
def test_bf16_blocks_are_checked_as_msl_3_1(path):
    """Every kernel family has bf16 kernels behind KRNL_BF16, outside which it uses no
    bfloat: its declared version (3.0) is checked without them and 3.1 with them."""
    text = path.read_text()
    blocks = "".join(BF16_BLOCK.findall(text))  # host names end in _bf16 (or are built from a bf16 macro argument)
    assert re.search(r"\bbfloat\b", blocks) and "bf16" in blocks, path.name
    assert md.checked_versions(path, md.declared_version(path)) == [md.declared_version(path), (3, 1)]


def test_bf16_blocks_use_the_one_guard():
    """metal/kargs.h says once when bfloat compiles (KRNL_BF16: __METAL_VERSION__ >= 310, MLX's
    check); every other file's bf16 block is `#if KRNL_BF16`, and none repeats a version or
    __HAVE_BFLOAT__ condition (or tests KRNL_BF16 with #ifdef/defined(), true even where it is 0)."""
    kargs = re.sub(r"//[^\n]*|/\*.*?\*/", "", (METAL / "kargs.h").read_text(), flags=re.S)
    assert re.search(r"^#if __METAL_VERSION__ >= 310\n#define KRNL_BF16 1\n#else\n#define KRNL_BF16 0\n#endif$",
                     kargs, re.M), "metal/kargs.h no longer defines KRNL_BF16 from __METAL_VERSION__ >= 310"
    for path in KERNELS:
        code = re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(), flags=re.S)
        for cond in re.findall(r"^[ \t]*#[ \t]*(?:if|ifdef|ifndef|elif)\b[^\n]*", code, re.M):
            assert "__HAVE_BFLOAT__" not in cond and "__METAL_VERSION__" not in cond, \
                f"{path.name}: `{cond.strip()}`: use `#if KRNL_BF16` (metal/kargs.h)"
            if "KRNL_BF16" in cond:
                assert re.fullmatch(r"#\s*if\s+KRNL_BF16\s*", cond.strip()), f"{path.name}: `{cond.strip()}`: write `#if KRNL_BF16`"
        assert not re.search(r"^\s*#\s*(define|undef)\s+KRNL_BF16\b", code, re.M), f"{path.name} redefines KRNL_BF16"
        assert BF16_BLOCK.search(code), f"{path.name} has no `#if KRNL_BF16` block"
        assert not _uses_bfloat(path), f"{path.name} uses bfloat outside its `#if KRNL_BF16` blocks"


def test_bf16_block_under_msl_3_0(tmp_path):
    """bfloat behind KRNL_BF16 passes in a 3.0 file, and what is wrong inside the block is
    still found (by the 3.1 pass, which names itself)."""
    compiler = _require(ANY, NO_COMPILER)
    path, _ = _plant(tmp_path, BF16_BODY.format(extra="", mark=""), version="3.0")
    assert md.checked_versions(path, (3, 0)) == [(3, 0), (3, 1)]
    assert not md.check(path, compiler=compiler)
    path, lines = _plant(tmp_path, BF16_BODY.format(extra=" * 0.5", mark="//!"), version="3.0")
    probs = md.check(path, compiler=compiler)
    _assert_bites(path, probs, {"double"}, lines)
    assert all("checked as MSL 3.1" in p.message for p in probs), probs


@pytest.mark.parametrize("first, why", [("#include <metal_stdlib>", "the first line must declare"),
                                        ("// msl: 4.0", "MSL 4.0 is not one of"),
                                        ("// msl: 2.4", "MSL 2.4 is not one of"),
                                        ("// msl 3.0", "the first line must declare")])
def test_missing_or_unknown_version_is_rejected(tmp_path, first, why):
    path = tmp_path / "bad.metal"
    path.write_text(first + "\n#include <metal_stdlib>\n")
    with pytest.raises(md.VersionError, match=re.escape(why)):
        md.declared_version(path)
    probs = md.check(path, compiler=_require(ANY, NO_COMPILER))
    assert [(p.rule, p.line) for p in probs] == [("version", 1)] and why in probs[0].message
    assert Path(probs[0].file).resolve() == path.resolve()


def test_library_msl_version_matches_the_files():
    from krnl import _core
    assert list(_core.metal_libraries()) == [p.stem for p in KERNELS]
    for path in KERNELS:
        major, minor = md.declared_version(path)
        assert _core.metal_library_msl_version(path.stem) == major * 100 + minor, path.name


def test_library_msl_version_unknown_name():
    from krnl import _core
    with pytest.raises(ValueError, match="no library 'nope' embedded"):
        _core.metal_library_msl_version("nope")
