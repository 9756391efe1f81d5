"""The Metal backend's macOS-only layer, checked where no Mac exists (docs/architecture.md, 'How Metal is tested without a Mac').

- csrc/metal/*.mm (Objective-C++, ARC) are syntax- and type-checked with clang against the
  hand-written Foundation/Metal declarations of tools/mslsim/objc/stubs; copies of device.mm with
  a planted mistake must be rejected at the planted line, so the check is known to bite.
- No Objective-C may leak into a header under csrc/ (the portable code includes them all).
- The MSL sources embedded in the binary by cmake/embed_metal.cmake: one per metal/*.metal, the
  same list as _core.metal_libraries(), every quoted include inlined, text identical to the files
  (re-derived here independently of the CMake script).
The macOS workflow (.github/workflows/macos.yml) builds and runs the real thing."""
import platform
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from krnl import _core

ROOT = Path(__file__).resolve().parents[1]
OBJC = ROOT / "tools" / "mslsim" / "objc"
METAL = ROOT / "metal"
MM_FILES = sorted((ROOT / "csrc" / "metal").glob("*.mm"))


def _clang():
    names = ["clang++"] + [f"clang++-{v}" for v in range(30, 13, -1)]
    return next((p for p in map(shutil.which, names) if p), None)


CLANG = _clang()
needs_clang = pytest.mark.skipif(
    CLANG is None, reason="clang++ not on PATH: the Objective-C++ check of csrc/metal/*.mm needs clang "
                          "(.ci/run installs it where it can)")


def _check(mm):
    flags = (OBJC / "flags.txt").read_text().split()
    cmd = [CLANG, *flags, f"-I{OBJC / 'stubs'}", f"-I{ROOT / 'csrc'}", f"-I{METAL}", str(mm)]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_metal_host_mm_files_exist():
    assert [p.name for p in MM_FILES] == ["device.mm"]


@needs_clang
@pytest.mark.parametrize("mm", MM_FILES, ids=[p.name for p in MM_FILES])
def test_metal_host_objc_check(mm):
    r = _check(mm)
    assert r.returncode == 0, r.stderr


# Each plant: (text in device.mm, its replacement, the error clang must report there).
PLANTS = [
    # a misspelt selector (under ARC an unknown selector is an error, not a warning)
    ("[enc setComputePipelineState:pipeline(d)]", "[enc setComputePipelineStat:pipeline(d)]", "not found"),
    # a C++ container where the API takes a pointer
    ("[enc setBytes:d.args.data() length:", "[enc setBytes:d.args length:", "no viable conversion"),
    # a selector of the wrong protocol (an encoder has no commit; the command buffer does)
    ("[cb commit];", "[enc commit];", "commit"),
    # a std::string where an NSString* is expected
    ("[lib newFunctionWithName:ns(d.kernel)]", "[lib newFunctionWithName:d.kernel]", "no viable conversion"),
]


@needs_clang
@pytest.mark.parametrize("plant", PLANTS, ids=["selector", "pointer", "protocol", "nsstring"])
def test_metal_host_objc_check_rejects_planted_error(tmp_path, plant):
    old, new, message = plant
    src = (ROOT / "csrc" / "metal" / "device.mm").read_text()
    assert old in src, f"the plant's anchor {old!r} is gone from device.mm: update the test"
    line = src[: src.index(old)].count("\n") + 1
    bad = tmp_path / "device_bad.mm"
    bad.write_text(src.replace(old, new, 1))
    r = _check(bad)
    assert r.returncode != 0, "clang accepted a planted error: the stubs are too permissive"
    errors = re.findall(rf"device_bad\.mm:(\d+):\d+: error: ([^\n]*)", r.stderr)
    assert errors, r.stderr
    assert any(int(n) == line and message in msg for n, msg in errors), (line, errors)


# ---------------------------------------------------------------------------------------------
# every SDK the build supports, at the deployment target
# ---------------------------------------------------------------------------------------------
# The SDKs the stubs can stand for (__MAC_OS_X_VERSION_MAX_ALLOWED): the oldest the build supports
# (Xcode 15's macOS 14 SDK: what it lacks is undeclared, per tools/metal_api/sdk14_availability.txt)
# and the newest the stubs know (macOS 15: its API carries API_AVAILABLE(macos(15.0))).
SDKS = {"macOS 14 SDK": 140000, "macOS 15 SDK": 150000}


def deployment_target():
    env = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["cibuildwheel"]["macos"]["environment"]
    return env["MACOSX_DEPLOYMENT_TARGET"]


def _check_sdk(mm, sdk, tmp_path):
    """device.mm as the Apple build compiles it: against the stubs standing for `sdk`, for a
    macOS target at the deployment target, an unguarded use of newer API an error (the flag
    CMakeLists.txt gives). Two steps: the host's C++ library headers only parse for the host
    target, so the file is preprocessed for it first (line markers keep the .mm's own lines)."""
    flags = [f for f in (OBJC / "flags.txt").read_text().split() if f != "-fsyntax-only"]
    pre = tmp_path / (mm.stem + f".{sdk}.mii")
    r = subprocess.run([CLANG, *flags, "-E", f"-D__MAC_OS_X_VERSION_MAX_ALLOWED={sdk}", f"-I{OBJC / 'stubs'}",
                        f"-I{ROOT / 'csrc'}", f"-I{METAL}", str(mm), "-o", str(pre)], capture_output=True, text=True)
    if r.returncode:
        return r
    arch = "arm64" if platform.machine().lower() in ("arm64", "aarch64") else "x86_64"
    return subprocess.run([CLANG, "-target", f"{arch}-apple-macos{deployment_target()}", "-x", "objective-c++-cpp-output",
                           "-std=c++17", "-fsyntax-only", "-fobjc-arc", "-fblocks", "-Werror=unguarded-availability-new",
                           str(pre)], capture_output=True, text=True)


@needs_clang
@pytest.mark.parametrize("sdk", SDKS.values(), ids=SDKS.keys())
@pytest.mark.parametrize("mm", MM_FILES, ids=[p.name for p in MM_FILES])
def test_metal_host_builds_on_every_sdk(mm, sdk, tmp_path):
    r = _check_sdk(mm, sdk, tmp_path)
    assert r.returncode == 0, r.stderr


# Each plant: (text in device.mm, its replacement, the SDK, the error clang must report there).
SDK_PLANTS = [
    # the language version of macOS 15 outside the SDK guard: undeclared in the macOS 14 SDK
    # (what device.mm did before: the build failed with Xcode 15)
    ("#if KRNL_SDK_MACOS15\n  if (v >= 302)", "#if 1\n  if (v >= 302)", 140000,
     "undeclared identifier 'MTLLanguageVersion3_2'"),
    # mathMode under the SDK guard but without the run-time check: an error at deployment target 14
    ("if (@available(macOS 15.0, *)) {\n      options.mathMode", "if (true) {\n      options.mathMode", 150000,
     "'setMathMode:' is only available on macOS 15.0 or newer"),
    # the language version without its run-time check: likewise
    ("if (@available(macOS 15.0, *)) {\n      options.languageVersion = MTLLanguageVersion3_2",
     "if (true) {\n      options.languageVersion = MTLLanguageVersion3_2", 150000,
     "'MTLLanguageVersion3_2' is only available on macOS 15.0 or newer"),
]


@needs_clang
@pytest.mark.parametrize("plant", SDK_PLANTS, ids=["sdk-guard", "available-property", "available-enum"])
def test_metal_host_sdk_check_rejects_planted_error(tmp_path, plant):
    old, new, sdk, message = plant
    src = (ROOT / "csrc" / "metal" / "device.mm").read_text()
    assert old in src, f"the plant's anchor {old!r} is gone from device.mm: update the test"
    bad = tmp_path / "device_bad.mm"
    bad.write_text(src.replace(old, new, 1))
    r = _check_sdk(bad, sdk, tmp_path)
    assert r.returncode != 0, "clang accepted a planted availability error"
    errors = re.findall(r"device_bad\.mm:(\d+):\d+: error: ([^\n]*)", r.stderr)
    lines = {n for n, msg in errors if message in msg}
    assert lines, r.stderr
    # reported in the planted block (within a few lines of the anchor)
    line = src[: src.index(old)].count("\n") + 1
    assert any(line <= int(n) <= line + 4 for n in lines), (line, errors)


def test_deployment_target_agrees():
    # pyproject (the wheels), CMakeLists.txt (any other macOS build), the policy's message floor
    # and the README say the same oldest macOS
    target = deployment_target()
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert re.findall(r'set\(CMAKE_OSX_DEPLOYMENT_TARGET "([\d.]+)"', cmake) == [target]
    major = target.split(".")[0]
    policy = (ROOT / "csrc" / "metal" / "policy.cpp").read_text()
    assert re.search(rf"std::max<uint32_t>\({major},", policy), "policy.cpp's macOS floor is not the deployment target"
    readme = (ROOT / "README.md").read_text()
    assert f"macOS {major} or later" in readme and f"deployment target is macOS {target}" in readme
    assert f"macOS {target} and later (the deployment target" in (ROOT / "docs" / "architecture.md").read_text()


def test_apple_targets_fail_on_unguarded_availability():
    # every target of ours gets the flag on Apple (the one _check_sdk compiles device.mm with)
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert re.search(r"if\(APPLE\)\s*set\(KRNL_APPLE_FLAGS -Werror=unguarded-availability-new\)", cmake)
    targets = re.findall(r"^(?:add_library|nanobind_add_module)\((\w+)", cmake, re.M)
    assert "krnl_metal" in targets and "_core" in targets
    for t in targets:
        assert f"target_compile_options({t} PRIVATE ${{KRNL_APPLE_FLAGS}})" in cmake, t


def test_no_objective_c_in_headers():
    # Headers are shared with portable C++: Objective-C types stay inside .mm files.
    objc = re.compile(r"#\s*import|@(interface|protocol|class|autoreleasepool)\b|\bid\s*<|\bNS[A-Z]\w*|\bMTL[A-Z]\w*")
    for h in sorted((ROOT / "csrc").rglob("*.h")):
        code = re.sub(r"/\*.*?\*/", "", h.read_text(), flags=re.S)
        code = re.sub(r"//[^\n]*", "", code)
        m = objc.search(code)
        assert m is None, f"{h.relative_to(ROOT)}: Objective-C in a header: {m.group(0)!r}"


# ---------------------------------------------------------------------------------------------
# embedded MSL sources
# ---------------------------------------------------------------------------------------------
_INCLUDE = re.compile(r'(^|\n)[ \t]*#[ \t]*include[ \t]*"([^"\n]+)"[^\n]*')
_PRAGMA_ONCE = re.compile(r"(^|\n)[ \t]*#[ \t]*pragma[ \t]+once[^\n]*")


def _inline(path, seen):
    """What cmake/embed_metal.cmake does, written again: quoted includes from metal/ then
    csrc/core/, each file once per library, `#pragma once` dropped."""
    text = path.read_bytes().decode("utf-8")
    out = ""
    while m := _INCLUDE.search(text):
        out += text[: m.start()] + ("\n" if m.group(1) else "")
        text = text[m.end():]
        name = m.group(2)
        inc = next((d / name for d in (METAL, ROOT / "csrc" / "core") if (d / name).exists()), None)
        assert inc is not None, f"{path.name} includes {name!r}, in neither metal/ nor csrc/core/"
        if inc in seen:
            out += f"// ---- {name}: already inlined above"
            continue
        seen.add(inc)
        body = _PRAGMA_ONCE.sub(r"\1", _inline(inc, seen))
        if not body.endswith("\n"):
            body += "\n"
        out += f"// ---- {name} (inlined by cmake/embed_metal.cmake)\n{body}// ---- end of {name}"
    return out + text


def test_metal_libraries_are_the_metal_files():
    assert list(_core.metal_libraries()) == sorted(p.stem for p in METAL.glob("*.metal"))


@pytest.mark.parametrize("name", sorted(p.stem for p in METAL.glob("*.metal")))
def test_metal_library_source_embedded(name):
    src = _core.metal_library_source(name)
    unresolved = [ln for ln in src.splitlines() if re.match(r'\s*#\s*include\s*"', ln)]
    assert not unresolved, f"{name}: unresolved includes {unresolved}"
    assert "#pragma once" not in src
    # kargs.h is inlined into every library (the argument structs); byte-for-byte the files.
    assert "// ---- kargs.h (inlined by cmake/embed_metal.cmake)" in src
    assert src == _inline(METAL / f"{name}.metal", set()), (
        f"the embedded {name} differs from metal/{name}.metal (+ includes): rebuild (cmake --build)")


def test_metal_library_source_unknown_name():
    with pytest.raises(ValueError, match="no library 'nope' embedded"):
        _core.metal_library_source("nope")


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not on PATH")
def test_embed_metal_script_standalone(tmp_path):
    # The script as the build runs it (cmake -P), into a fresh file: one entry per .metal, the
    # chunks under the 16 KB literal limit, and a clear failure on an unresolvable include.
    out = tmp_path / "metal_sources.h"
    r = subprocess.run(["cmake", f"-DSOURCE_DIR={ROOT}", f"-DOUTPUT={out}", "-P", str(ROOT / "cmake" / "embed_metal.cmake")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    header = out.read_text()
    names = re.findall(r'^    \{"(\w+)", \w+_chunks, \d+, \d+\},$', header, re.M)
    assert names == sorted(p.stem for p in METAL.glob("*.metal"))
    chunks = re.findall(r'R"krnl_msl\((.*?)\)krnl_msl"', header, re.S)
    assert chunks and max(len(c.encode()) for c in chunks) <= 16000

    fake = tmp_path / "repo"
    (fake / "metal").mkdir(parents=True)
    (fake / "metal" / "broken.metal").write_text('#include <metal_stdlib>\n#include "missing.h"\n')
    r = subprocess.run(["cmake", f"-DSOURCE_DIR={fake}", f"-DOUTPUT={tmp_path / 'x.h'}", "-P",
                        str(ROOT / "cmake" / "embed_metal.cmake")], capture_output=True, text=True)
    assert r.returncode != 0 and 'broken.metal includes "missing.h"' in r.stderr, r.stderr
