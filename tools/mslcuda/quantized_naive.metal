// msl: 3.0
// The naive quantized_matmul that metal/quantized.metal had before its tiled form (commit b993b5d),
// kept only as the baseline of tools/mslcuda/qmm_timing.py: one thread per output element, a
// grid-stride loop over N * M, each dequantizing the codes it needs on the fly (nothing staged in
// threadgroup memory). It reads the leading fields of QuantizedMatmulArgs (whole products only:
// m0 = 0). The host used 256 threads and min(1024, ceil(N * M / 256)) threadgroups.
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
kernel void quantized_matmul_naive(device const T*    x      [[buffer(0)]],
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

template [[host_name("quantized_matmul_naive_t_f16_b4")]] [[kernel]]
decltype(quantized_matmul_naive<half, half, 4, true>) quantized_matmul_naive<half, half, 4, true>;
template [[host_name("quantized_matmul_naive_n_f16_b4")]] [[kernel]]
decltype(quantized_matmul_naive<half, half, 4, false>) quantized_matmul_naive<half, half, 4, false>;
