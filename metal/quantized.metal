// msl: 3.0 (krnl's floor; newest feature used: nothing past MSL 2.0)
// quantized_matmul: out (N, M) = x (N, K) op(W) + beta * out with W (O, I) quantized as MLX does
// (metal/kargs.h QuantizedMatmulArgs; csrc/core/op_list.h has the layout): codes packed 32 / BITS
// to a 32-bit word, W[o, j] = scales[o, j / gs] * q + biases[o, j / gs].
//   quantized_matmul_t_*:  transpose, out (N, O) = x (N, I) W^T  (a linear's forward)
//   quantized_matmul_n_*:  out (N, I) = x (N, O) W               (its input gradient)
// Names: quantized_matmul_{t,n}_<x dtype>[_sf32]_b<bits>; _sf32 when scales and biases are f32
// while x is 16-bit. x and out share a dtype; products accumulate in float, out rounds once.
//
// A first, untuned kernel: one thread per output element, a grid-stride loop over N * M, each
// dequantizing the codes it needs on the fly (W is never dequantized whole, and nothing is staged
// in threadgroup memory). Any threadgroup shape; the host uses 256 threads. Correct at any N, M,
// K; a tiled SIMD-group version is for later, on a Mac that can time it.
#include <metal_stdlib>
#include "kargs.h"
using namespace metal;

template <int BITS>
inline float dequant(device const uint* w, uint words, uint o, uint j, float s, float b)
{
    constexpr uint PER = 32 / BITS, MASK = (1u << BITS) - 1u;
    const uint q = (w[o * words + j / PER] >> ((j % PER) * BITS)) & MASK;
    return s * float(q) + b;
}

template <typename T, typename S, int BITS, bool TRANSPOSE>
kernel void quantized_matmul(device const T*    x      [[buffer(0)]],
                             device const uint* w      [[buffer(1)]],
                             device const S*    scales [[buffer(2)]],
                             device const S*    biases [[buffer(3)]],
                             device T*          out    [[buffer(4)]],
                             constant QuantizedMatmulArgs& args [[buffer(5)]],
                             uint gid [[thread_position_in_grid]],
                             uint gsz [[threads_per_grid]])
{
    const uint total = args.N * args.M, gs = args.group_size, words = args.words;
    const uint I = TRANSPOSE ? args.K : args.M, G = I / gs;
    for (uint e = gid; e < total; e += gsz) {
        const uint n = e / args.M, m = e % args.M;
        device const T* xr = x + n * args.K;
        float acc = 0.0f;
        if (TRANSPOSE) {  // o = m: one row of W, group by group
            for (uint g = 0; g < G; ++g) {
                const float s = float(scales[m * G + g]), b = float(biases[m * G + g]);
                for (uint j = g * gs; j < (g + 1) * gs; ++j)
                    acc = fma(float(xr[j]), dequant<BITS>(w, words, m, j, s, b), acc);
            }
        } else {          // j = m: one column of W, down its rows
            const uint g = m / gs;
            for (uint o = 0; o < args.K; ++o)
                acc = fma(float(xr[o]), dequant<BITS>(w, words, o, m, float(scales[o * G + g]), float(biases[o * G + g])),
                          acc);
        }
        // beta == 0 never reads out (it may hold NaN)
        out[e] = T(args.beta != 0.0f ? fma(args.beta, float(out[e]), acc) : acc);
    }
}

#define QMM_KERNELS(T, S, NAME)                                                                              \
    template [[host_name("quantized_matmul_t_" NAME "_b2")]] [[kernel]]                                 \
    decltype(quantized_matmul<T, S, 2, true>) quantized_matmul<T, S, 2, true>;                            \
    template [[host_name("quantized_matmul_t_" NAME "_b4")]] [[kernel]]                                 \
    decltype(quantized_matmul<T, S, 4, true>) quantized_matmul<T, S, 4, true>;                            \
    template [[host_name("quantized_matmul_t_" NAME "_b8")]] [[kernel]]                                 \
    decltype(quantized_matmul<T, S, 8, true>) quantized_matmul<T, S, 8, true>;                            \
    template [[host_name("quantized_matmul_n_" NAME "_b2")]] [[kernel]]                                 \
    decltype(quantized_matmul<T, S, 2, false>) quantized_matmul<T, S, 2, false>;                          \
    template [[host_name("quantized_matmul_n_" NAME "_b4")]] [[kernel]]                                 \
    decltype(quantized_matmul<T, S, 4, false>) quantized_matmul<T, S, 4, false>;                          \
    template [[host_name("quantized_matmul_n_" NAME "_b8")]] [[kernel]]                                 \
    decltype(quantized_matmul<T, S, 8, false>) quantized_matmul<T, S, 8, false>;

QMM_KERNELS(float, float, "f32")
QMM_KERNELS(half, half, "f16")
QMM_KERNELS(half, float, "f16_sf32")

#if defined(__HAVE_BFLOAT__)
// bf16 activations (MSL 3.1, native on Apple9+), scales in bf16 or f32, accumulated in float.
QMM_KERNELS(bfloat, bfloat, "bf16")
QMM_KERNELS(bfloat, float, "bf16_sf32")
#endif
