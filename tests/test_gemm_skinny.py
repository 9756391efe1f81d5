"""The CUDA backend's skinny GEMM (csrc/cuda/skinny_gemm.h, .cuh): the LoRA products with a side of
at most 64 and a long reduction run on its own tensor-core kernel instead of cuBLAS. The routing
rule is checked everywhere (a pure function); the kernel on cuda against a float64 oracle at
sizes on the 16-grid that are otherwise awkward (31, 33, 63, 127 tiles), with column-block
operands and outputs, K sliced over blocks or not, against cuBLAS (KRNL_CUDA_SKINNY_GEMM=0),
bit for bit from one call to the next, and inside a recorded CUDA graph."""

import numpy as np
import pytest

import krnl
from krnl import ops

from conftest import empty_filled, read, upload
from test_gemm import check, gemm_bound

plan = krnl._core.testing.plan_skinny_gemm
TRANS = {"nn": (False, False), "nt": (False, True), "tn": (True, False)}


def test_plan_skinny_gemm_takes_the_lora_products():
    """Llama-1B's LoRA GEMMs at 8192 rows (krnl bench --workloads train): the long-reduction ones
    take the kernel, K split over blocks until two per SM; the rank-K outer products keep cuBLAS."""
    rows, C, F = 8192, 2048, 8192
    ROWS, COLS = 1, 2
    # (M, N, K, ta, tb, lda, ldb) -> (mode, frags, narrow_n, splits, tiles)
    cases = {
        (rows, 48, C, False, True, C, C): (ROWS, 3, True, 1, 512),          # t = x A_qkv^T
        (rows, 16, F, False, True, F, F): (ROWS, 1, True, 1, 512),          # down: t = x A^T
        (rows, 16, 512, False, False, 3072, 16): (ROWS, 1, True, 1, 512),   # dt = dy_k B, dy a column block
        (C, 16, rows, True, False, 3072, 48): (COLS, 1, True, 32, 16),      # dB = dy^T t
        (512, 16, rows, True, False, 3072, 48): (COLS, 1, True, 32, 4),     # slices stay >= 256 rows
        (48, C, rows, True, False, 48, C): (COLS, 3, False, 32, 16),        # dA = dt^T x, grouped
        (16, F, rows, True, False, 16, F): (COLS, 1, False, 8, 64),
        (64, 64, 256, False, False, 256, 64): (ROWS, 4, True, 1, 4),        # both narrow: N's
    }
    for (M, N, K, ta, tb, lda, ldb), want in cases.items():
        assert plan(M, N, K, ta, tb, lda, ldb) == want, (M, N, K, ta, tb)
    assert plan(C, 16, rows, True, False, sm_count=8)[3] == 1  # a small GPU is filled without slicing
    keep = [  # each keeps cuBLAS
        dict(M=rows, N=C, K=16, trans_b=True),                   # y = t B^T: rank-16 K
        dict(M=rows, N=C, K=48),                                 # dx = dt A
        dict(M=rows, N=16, K=C, trans_a=True, trans_b=True),     # tt
        dict(M=rows, N=16, K=C, trans_a=False, trans_b=True, elem_bytes=4),  # f32 operands
        dict(M=rows, N=16, K=C, batch=2),
        dict(M=rows + 1, N=16, K=C), dict(M=rows, N=17, K=C),
        dict(M=rows, N=16, K=C + 16),                            # rows mode: K off its 128-stages
        dict(M=C + 16, N=16, K=rows, trans_a=True),              # columns mode: M off its 128-blocks
        dict(M=16, N=C + 16, K=rows, trans_a=True),
        dict(M=16, N=C, K=rows, trans_a=True, trans_b=True),
        dict(M=rows, N=16, K=C, lda=C + 4),                      # a row stride off 16 bytes
        dict(M=rows, N=16, K=C, aligned32=False),
        dict(M=rows, N=16, K=128),                               # short reduction
        dict(M=80, N=80, K=C),                                   # no side <= 64
    ]
    for kw in keep:
        assert plan(**kw)[0] == 0, kw


cuda_only = pytest.mark.skipif("cuda" not in krnl.devices(), reason="the skinny kernel is the CUDA backend's")


@pytest.fixture(scope="module")
def cuda():
    return krnl.device("cuda")


def _sm(cuda):
    return int(cuda.capabilities()["details"]["sm_count"])


# (M, N, K) per transpose form, each taking the kernel: rows mode (N <= 64, K on 128-stages) with
# and without K slices; columns mode (dB = dy^T t: M on 128-column blocks; dA = dt^T x: N).
ROWS_SHAPES = [(496, 16, 640), (1008, 48, 4096), (2032, 16, 1024), (64, 64, 256), (16, 32, 384)]
COLS_N = [(384, 16, 528), (640, 48, 4096), (128, 64, 272)]
COLS_M = [(32, 1920, 2048), (48, 384, 1040), (16, 128, 256)]
SHAPES = {"nn": ROWS_SHAPES + COLS_M, "nt": ROWS_SHAPES, "tn": COLS_N + COLS_M}


def _operands(cuda, rng, M, N, K, ta, tb, dt, pad):
    """A stored (M, K) / (K, M) and B stored (K, N) / (N, K), each a column block of a buffer
    `pad` columns wider (a fused projection's block); their float64 op(A), op(B) and row strides."""
    a_shape, b_shape = ((K, M) if ta else (M, K)), ((N, K) if tb else (K, N))
    Aw, aw = upload(cuda, rng.standard_normal((a_shape[0], a_shape[1] + pad)), dt)
    Bw, bw = upload(cuda, rng.standard_normal((b_shape[0], b_shape[1] + pad)), dt)
    A, B = Aw[:, pad:], Bw[:, pad:]
    a, b = aw[:, pad:], bw[:, pad:]
    return A, B, (a.T if ta else a), (b.T if tb else b), a_shape[1] + pad, b_shape[1] + pad


@cuda_only
@pytest.mark.parametrize("trans", list(TRANS))
@pytest.mark.parametrize("dt,cdt", [("bf16", "bf16"), ("bf16", "f32"), ("f16", "f16"), ("f16", "f32")])
def test_skinny_gemm_matches_oracle(cuda, trans, dt, cdt):
    ta, tb = TRANS[trans]
    rng = np.random.default_rng(3)
    for M, N, K in SHAPES[trans]:
        for pad in (0, 32):
            A, B, opa, opb, lda, ldb = _operands(cuda, rng, M, N, K, ta, tb, dt, pad)
            p = plan(M, N, K, ta, tb, lda, ldb, sm_count=_sm(cuda))
            assert p[0] > 0, f"{trans} {M}x{N}x{K}: the test shape must take the kernel"
            what = f"{trans} {dt}->{cdt} {M}x{N}x{K} pad {pad} mode {p[0]} splits {p[3]}"
            C, c0 = upload(cuda, rng.standard_normal((M, N)), cdt)
            ops.gemm(A, B, C, trans_a=ta, trans_b=tb, alpha=0.5, beta=-1.25)
            check(C, 0.5 * opa @ opb - 1.25 * c0, K, cdt, 0.5, opa, opb, -1.25, c0, what=what)
            # into columns 16:16+N of a wider output, beta 0 over NaNs (never read, nothing else written)
            wide = empty_filled(cuda, (M, N + 32), cdt)
            ops.gemm(A, B, wide[:, 16:16 + N], trans_a=ta, trans_b=tb)
            got = read(wide)
            assert np.all(np.isnan(got[:, :16])) and np.all(np.isnan(got[:, 16 + N:])), f"{what}: wrote outside"
            check(wide[:, 16:16 + N], opa @ opb, K, cdt, 1.0, opa, opb, what=what + " block")


@cuda_only
@pytest.mark.parametrize("trans", list(TRANS))
def test_skinny_gemm_repeats_bits_and_agrees_with_cublas(cuda, trans, monkeypatch):
    ta, tb = TRANS[trans]
    rng = np.random.default_rng(4)
    for M, N, K in SHAPES[trans]:
        A, B, opa, opb, _, _ = _operands(cuda, rng, M, N, K, ta, tb, "bf16", 0)
        c0 = rng.standard_normal((M, N)).astype(np.float32)
        outs = []
        for off in ("1", "1", "0"):
            monkeypatch.setenv("KRNL_CUDA_SKINNY_GEMM", off)
            C = cuda.tensor(c0, "f32")
            ops.gemm(A, B, C, trans_a=ta, trans_b=tb, alpha=2.0, beta=1.0)  # a LoRA gradient's +=
            outs.append(read(C))
        assert np.array_equal(outs[0], outs[1]), f"{trans} {M}x{N}x{K}: two calls differ"
        ref = 2.0 * opa @ opb + c0
        bound = gemm_bound(K, "f32", ref, 2.0, opa, opb, 1.0, c0)
        for got, name in ((outs[0], "kernel"), (outs[2], "cuBLAS")):
            err = float(np.max(np.abs(got - ref)))
            assert err <= bound, f"{trans} {M}x{N}x{K} {name}: max error {err:.3e} > {bound:.3e}"


@cuda_only
def test_skinny_gemm_in_a_graph_replays_the_eager_bits(cuda):
    """K sliced over blocks (f32 partials in pool scratch, then the reduce) inside a recording."""
    rng = np.random.default_rng(5)
    M, N, K = 512, 16, 8192
    assert plan(M, N, K, True, False, sm_count=_sm(cuda))[3] > 1
    dy = cuda.tensor(rng.standard_normal((K, M)).astype(np.float32), "bf16")
    t = cuda.tensor(rng.standard_normal((K, N)).astype(np.float32), "bf16")

    def step():
        g = cuda.empty((M, N), "f32")
        ops.fill(g, 0.0)
        ops.gemm(dy, t, g, trans_a=True, beta=1.0)  # dB += dy^T t
        return g

    with cuda.step():
        eager = step()
    eager = read(eager)
    graph = krnl.cuda_graph(cuda, step)
    graph.replay()
    assert np.array_equal(read(graph.outputs), eager)
    cuda.upload(dy, rng.standard_normal((K, M)).astype(np.float32))  # new contents, same tensor
    graph.replay()
    with cuda.step():
        again = step()
    again = read(again)  # after the step: results are read once it is committed
    assert np.array_equal(read(graph.outputs), again) and not np.array_equal(again, eager)
    graph.release()
