"""The MSL -> CUDA translator of tools/mslcuda (the metal-cuda test device's): every .metal file of
metal/ translates, each [[host_name]] kernel gets its wrapper, the MSL forms it rewrites come out
as CUDA, and, where nvcc exists, every translated library compiles for sm_90 (no GPU needed).
Running the kernels needs an NVIDIA GPU: KRNL_TEST_METAL_CUDA=1 puts the "metal-cuda" device
into every module's `dev` tests (tools/device/h200_check.sh metal-cuda)."""
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "mslcuda"))

import mslcuda  # noqa: E402

METAL = ROOT / "metal"
INCLUDES = [METAL, ROOT / "csrc" / "core"]
FORMS = Path(__file__).resolve().parent / "mslcuda_kernels" / "forms.metal"
# (file, function constants) as the Metal backend dispatches them: gemm's alignment both ways
VARIANTS = [(p.stem, {}) for p in sorted(METAL.glob("*.metal")) if p.stem != "gemm"] + [("gemm", {0: True}),
                                                                                       ("gemm", {0: False})]


def host_names(path):
    """The kernels a .metal file exports, from its preprocessed text (host names built by macros,
    as attention.metal's, expanded; bfloat ones included: mslcuda compiles as MSL 3.1, so KRNL_BF16 is on)."""
    text = mslcuda.preprocess(path, include_dirs=INCLUDES)
    # adjacent string literals ("attention_forward_d" "64" "_" "f16") are one name
    return {"".join(re.findall(r'"(\w*)"', m)) for m in re.findall(r'host_name\(((?:\s*"\w*")+)\s*\)', text)}


@pytest.mark.parametrize("name,constants", VARIANTS, ids=[f"{n}{'-' + str(c[0]) if c else ''}" for n, c in VARIANTS])
def test_every_metal_file_translates(name, constants):
    tr = mslcuda.translate_file(METAL / f"{name}.metal", constants, include_dirs=INCLUDES)
    want = host_names(METAL / f"{name}.metal")
    assert want and want <= set(tr.kernels), sorted(want - set(tr.kernels))
    for host in tr.kernels:
        assert f"__global__ void __launch_bounds__(1024) msl_{host}(" in tr.code
    assert not re.search(r"\b(?:device|threadgroup|kernel)\s+(?:const\s+)?\w+\s*[*&]", tr.code.split("// ---- kernel wrappers")[0]), \
        "an MSL address space survived"


def test_msl_forms_become_cuda():
    tr = mslcuda.translate_file(FORMS, {0: True})
    code = tr.code
    assert set(tr.kernels) == {"forms_f32", "forms_f16", "forms_bf16", "plain"}
    assert tr.kernels["forms_bf16"] == "forms<bfloat>"
    # function constants: set, unset, and is_function_constant_defined of each
    assert "static constexpr bool use_bias = true;" in code
    assert "static constexpr bool has_scale = bool();" in code
    assert "static constexpr bool bias_on = true && use_bias;" in code
    assert "(false ? scale : 1.0f)" in code
    # an unset constant's parameter is passed as null
    assert "f = &forms<float>; f(mslcuda::buffer(lp, 0), mslcuda::buffer(lp, 1), mslcuda::buffer(lp, 2), mslcuda::BufArg{nullptr}," in code
    # program-scope constants: an array in __constant__ memory, a scalar as constexpr
    assert "__constant__ const float weights[3] = {0.25f, 0.5f, 0.25f};" in code
    assert "static constexpr int K = 3;" in code
    # every function and member function is device code, declarations included
    assert "template <typename T> __device__ inline T two();" in code
    assert "template <typename T, typename U = T> __device__ inline U twice(T x)" in code
    assert "template <> __device__ inline half two<half>() { return half(2.0f); }" in code
    assert "__device__ void add(float x)" in code and "__device__ float get() const" in code
    assert "__device__ static float tri(" in code
    # threadgroup variables, literals, pragmas
    assert "__shared__  float buf[64];" in code and "__shared__  T tile[64];" in code
    assert "#pragma unroll" in code and "clang loop" not in code
    assert "(bias_on ? 1.0f : 0.5f)" in code
    # line numbers kept: `plain` sits on the same line as in the source
    src_line = next(i for i, l in enumerate(FORMS.read_text().splitlines(), 1) if "void plain(" in l)
    marker_line = None
    for line in code.splitlines():
        m = re.match(r'# (\d+) "mslcuda_kernels/forms.metal"', line)
        if m:
            marker_line, n = int(m.group(1)), 0
        elif marker_line is not None:
            n += 1
            if "void plain(" in line:
                assert marker_line + n - 1 == src_line
                break
    else:
        pytest.fail("no line marker before `plain`")


def test_unsupported_forms_are_refused(tmp_path):
    p = tmp_path / "tgparam.metal"
    p.write_text("#include <metal_stdlib>\nusing namespace metal;\n"
                 "kernel void k(device float* x [[buffer(0)]], threadgroup float* t [[threadgroup(0)]]) { x[0] = t[0]; }\n")
    with pytest.raises(mslcuda.MslcudaError, match=r"\[\[threadgroup\(0\)\]\] parameters are not supported"):
        mslcuda.translate_file(p)
    p.write_text("#include <metal_stdlib>\nusing namespace metal;\nconstant bool a [[function_constant(0)]];\n"
                 "kernel void k(device float* x [[buffer(0)]]) { x[0] = a ? 1.0f : 0.0f; }\n")
    with pytest.raises(mslcuda.MslcudaError, match="not declared"):
        mslcuda.translate_file(p, {"b": True})


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: the compile check needs the CUDA toolkit")
def test_every_translation_compiles_with_nvcc():
    """Each library and the forms file compile for sm_90 (cached by content hash, so a warm run
    compiles nothing); nvcc errors would name the .metal line."""
    jobs = [(METAL / f"{n}.metal", c, INCLUDES) for n, c in VARIANTS] + [(FORMS, {0: True}, [])]
    with ThreadPoolExecutor(max_workers=2) as pool:
        sos = list(pool.map(lambda j: mslcuda.build(j[0], j[1], include_dirs=j[2], load=False), jobs))
    assert all(Path(s).stat().st_size > 0 for s in sos)


def test_sanitize_driver_calls_are_accepted_on_metal_sim():
    """tools/mslcuda/sanitize.py's calls (every op at ragged sizes, the optimizers' steps among them)
    are each accepted by the Metal backend: run as its dry run on metal-sim, in a process of its own
    (it registers the device itself), since compute-sanitizer runs it only on a lent GPU."""
    from conftest import METAL_SIM
    if METAL_SIM is None:
        pytest.skip("metal-sim is off (KRNL_TEST_METAL_SIM=0)")
    import os
    import subprocess
    import krnl
    here = str(Path(krnl.__file__).resolve().parents[1])  # the krnl these tests import (a build or an install)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "mslcuda" / "sanitize.py"), "kernels", "metal-sim"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and "every call accepted" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
