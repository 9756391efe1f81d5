// msl: 3.0 (krnl's floor; newest feature used: 64-bit indices (ulong), MSL 2.x)
// Embedding lookup and its gradient. Ids are (n,) i32, checked on the host before the dispatch
// (as the CPU backend does); an id outside [0, V) still never touches memory out of range here:
// the forward writes a NaN row for it (so a missed check shows), the backward skips it. moe_gather
// runs the forward over moe_sort's tokens, which no host checks (a GPU kernel wrote them).
#include <metal_stdlib>
#include "kargs.h"
using namespace metal;

// A quiet NaN made from its bits, not by a float operation that fast math may assume away.
template <typename T> inline T quiet_nan();
template <> inline float quiet_nan<float>() { return as_type<float>(0x7fc00000u); }
template <> inline half  quiet_nan<half>()  { return as_type<half>(ushort(0x7e00)); }
#if KRNL_BF16
template <> inline bfloat quiet_nan<bfloat>() { return as_type<bfloat>(ushort(0x7fc0)); }
#endif

// embedding_forward: out[t, c] = table[ids[t], c], a plain copy (no rounding: T in, T out).
// Geometry: a 1D grid-stride loop over the n * C output elements (row-major, so adjacent lanes
// copy adjacent columns of one row), any grid; e.g. 256 threads per threadgroup and
// min(ceil(n * C / 256), 1024) threadgroups.
template <typename T>
kernel void embedding_forward(device const int*       ids   [[buffer(0)]],
                              device const T*         table [[buffer(1)]],
                              device T*               out   [[buffer(2)]],
                              constant EmbeddingArgs& args  [[buffer(3)]],
                              uint gid [[thread_position_in_grid]],
                              uint gsz [[threads_per_grid]])
{
    const uint C = args.C, V = args.V;
    const ulong total = (ulong)args.n * C;
    if (total + gsz <= 0xffffffffu) {  // uniform: 32-bit index math (a 64-bit divide is emulated), i + gsz cannot wrap
        for (uint i = gid; i < uint(total); i += gsz) {
            const uint t = i / C;
            const int id = ids[t];
            if (uint(id) < V)  // negative ids wrap to huge values
                out[i] = table[(ulong)id * C + (i - t * C)];
            else
                out[i] = quiet_nan<T>();
        }
    } else {
        for (ulong i = gid; i < total; i += gsz) {
            const ulong t = i / C;
            const int id = ids[t];
            if (uint(id) < V)
                out[i] = table[(ulong)id * C + (i - t * C)];
            else
                out[i] = quiet_nan<T>();
        }
    }
}

// embedding_backward: dtable[ids[t], c] += float(dout[t, c]) for t = 0, 1, .., n - 1 in order,
// dtable f32 (accumulated, not overwritten). Deterministic without atomics: each thread owns
// whole columns and walks all tokens in order, so repeated ids accumulate in token order, the
// same float sums as the CPU backend's serial loop (bit for bit). Adjacent lanes own adjacent
// columns, so every token's dout row and dtable row are read coalesced.
// Geometry: a 1D grid-stride loop over columns: any grid; the natural one is threads
// (min(C, 256), 1, 1) per threadgroup and ceil(C / 256) threadgroups (more threads than C do
// nothing: tokens are not split across threads, that would race or lose determinism).
template <typename T>
kernel void embedding_backward(device const int*       ids    [[buffer(0)]],
                               device const T*         dout   [[buffer(1)]],
                               device float*           dtable [[buffer(2)]],
                               constant EmbeddingArgs& args   [[buffer(3)]],
                               uint gid [[thread_position_in_grid]],
                               uint gsz [[threads_per_grid]])
{
    const uint C = args.C, n = args.n, V = args.V;
    for (uint c = gid; c < C; c += gsz) {
        for (uint t = 0; t < n; ++t) {
            const int id = ids[t];
            if (uint(id) >= V) continue;
            dtable[(ulong)id * C + c] += float(dout[(ulong)t * C + c]);
        }
    }
}

template [[host_name("embedding_forward_f32")]] [[kernel]]
decltype(embedding_forward<float>) embedding_forward<float>;
template [[host_name("embedding_forward_f16")]] [[kernel]]
decltype(embedding_forward<half>) embedding_forward<half>;
template [[host_name("embedding_backward_f32")]] [[kernel]]
decltype(embedding_backward<float>) embedding_backward<float>;
template [[host_name("embedding_backward_f16")]] [[kernel]]
decltype(embedding_backward<half>) embedding_backward<half>;
#if KRNL_BF16
template [[host_name("embedding_forward_bf16")]] [[kernel]]
decltype(embedding_forward<bfloat>) embedding_forward<bfloat>;
template [[host_name("embedding_backward_bf16")]] [[kernel]]
decltype(embedding_backward<bfloat>) embedding_backward<bfloat>;
#endif
