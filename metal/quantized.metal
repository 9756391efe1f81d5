// msl: 3.0 (krnl's floor; newest feature used: nothing past MSL 2.0)
// quantized_matmul: out (N, M) = x (N, K) op(W) + beta * out with W (O, I) quantized as MLX does
// (metal/kargs.h QuantizedMatmulArgs; csrc/core/op_list.h has the layout): each row's codes one
// little-endian bit stream of 32-bit words (3, 5 and 6 bits straddle words),
// W[o, j] = scales[o, j / gs] * q + biases[o, j / gs]. x and out rows are args.ldx / args.ldo apart.
//   quantized_matmul_t_*:  transpose, out (N, O) = x (N, I) W^T  (a linear's forward)
//   quantized_matmul_n_*:  out (N, I) = x (N, O) W               (its input gradient)
//   quantized_embedding_*: out (n, C) = rows ids of the table W, dequantized
// Names: quantized_matmul_{t,n}_<x dtype>[_sf32]_b<bits> (quantized_embedding_<out dtype>...); _sf32 when scales and biases are f32
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
    constexpr uint MASK = (1u << BITS) - 1u;
    device const uint* row = w + o * words;
    const uint bit = j * BITS, wi = bit >> 5, sh = bit & 31u;
    uint q = row[wi] >> sh;
    if (32 % BITS != 0 && sh + BITS > 32)  // only widths that do not divide 32 straddle words
        q |= row[wi + 1] << (32 - sh);
    return s * float(q & MASK) + b;
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
        device const T* xr = x + n * args.ldx;
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
        device T* o = out + n * args.ldo + m;
        *o = T(args.beta != 0.0f ? fma(args.beta, float(*o), acc) : acc);
    }
}

// quantized_embedding: out[t, c] = the dequantized table[ids[t], c]; one thread per output element
// (grid-stride, any grid). Ids are checked on the host; one outside [0, V) still reads nothing
// out of range and writes NaN (so a missed check shows).
template <typename T, typename S, int BITS>
kernel void quantized_embedding(device const int*   ids    [[buffer(0)]],
                                device const uint*  w      [[buffer(1)]],
                                device const S*     scales [[buffer(2)]],
                                device const S*     biases [[buffer(3)]],
                                device T*           out    [[buffer(4)]],
                                constant QuantizedEmbeddingArgs& args [[buffer(5)]],
                                uint gid [[thread_position_in_grid]],
                                uint gsz [[threads_per_grid]])
{
    const uint C = args.C, G = C / args.group_size, total = args.n * C;
    for (uint i = gid; i < total; i += gsz) {
        const uint t = i / C, c = i - t * C;
        const int id = ids[t];
        if (uint(id) < args.V) {
            const uint g = uint(id) * G + c / args.group_size;
            out[i] = T(dequant<BITS>(w, args.words, uint(id), c, float(scales[g]), float(biases[g])));
        } else {
            out[i] = T(as_type<float>(0x7fc00000u));
        }
    }
}

#define QMM_KERNEL(T, S, NAME, BITS)                                                                         \
    template [[host_name("quantized_matmul_t_" NAME "_b" #BITS)]] [[kernel]]                            \
    decltype(quantized_matmul<T, S, BITS, true>) quantized_matmul<T, S, BITS, true>;                      \
    template [[host_name("quantized_matmul_n_" NAME "_b" #BITS)]] [[kernel]]                            \
    decltype(quantized_matmul<T, S, BITS, false>) quantized_matmul<T, S, BITS, false>;                    \
    template [[host_name("quantized_embedding_" NAME "_b" #BITS)]] [[kernel]]                           \
    decltype(quantized_embedding<T, S, BITS>) quantized_embedding<T, S, BITS>;

#define QMM_KERNELS(T, S, NAME)                                                                              \
    QMM_KERNEL(T, S, NAME, 2) QMM_KERNEL(T, S, NAME, 3) QMM_KERNEL(T, S, NAME, 4)                           \
    QMM_KERNEL(T, S, NAME, 5) QMM_KERNEL(T, S, NAME, 6) QMM_KERNEL(T, S, NAME, 8)

QMM_KERNELS(float, float, "f32")
QMM_KERNELS(half, half, "f16")
QMM_KERNELS(half, float, "f16_sf32")

#if KRNL_BF16
// bf16 activations (MSL 3.1, native on Apple9+), scales in bf16 or f32, accumulated in float.
QMM_KERNELS(bfloat, bfloat, "bf16")
QMM_KERNELS(bfloat, float, "bf16_sf32")
#endif
