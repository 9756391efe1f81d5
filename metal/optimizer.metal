// msl: 3.0 (krnl's floor; newest feature used: simd_sum/simd_any and a device atomic_int, MSL 2.x)
// Optimizer-step kernels: AdamW (and Adam), SGD and Lion over flat f32 buffers, Adafactor per
// parameter, the two-pass sum of squares (global grad norm) and the inf/NaN flag (dynamic loss
// scaling). Geometry per kernel below.
#include <metal_stdlib>
#include "kargs.h"
using namespace metal;

// ---- adamw_update, adamw_update_working_{f32,f16}
// params, grads, m, v (n,) f32 at buffers 0..3; the working variants also store the updated
// params into buffer(4) (f32 or f16, rounded once); AdamwArgs at buffer(5) for all three (index 4
// is unused by the plain kernel), hyper, sq and flag at 6, 7, 8 (read only as AdamwArgs says).
// The statement order and the float operations are those of the CPU backend (PyTorch's AdamW, see
// kargs.h); sqrt and the divides are the precise ones so that fast math does not drift from it.
// Geometry: a grid-stride loop, any grid; e.g. 256 threads per threadgroup and
// min(ceil(n / 256), 1024) threadgroups.
// The step's scalars: from args, or (args.device_scalars) from hyper, sq and flag on the device,
// each thread forming the same values in the same f32 order (kargs.h). skip: a non-finite step,
// on which nothing is written; the sq test is on its bits, which fast math cannot fold away.
// Shared by every optimizer kernel: hyper[3] = inv_denom, hyper[4] = max_norm.
struct ClipScalars {
    bool  skip;
    float grad_scale;
};

static inline ClipScalars clip_scalars(device const float* hyper, device const float* sq, device const int* flag,
                                       uint use_flag)
{
    const float s = sq[0];
    if ((use_flag != 0 && flag[0] != 0) || (as_type<uint>(s) & 0x7f800000u) == 0x7f800000u) return {true, 0.0f};
    const float inv_denom = hyper[3], max_norm = hyper[4];
    const float norm = precise::sqrt(s) * inv_denom;
    const float clip = max_norm > 0.0f ? min(1.0f, precise::divide(max_norm, norm + 1e-6f)) : 1.0f;
    return {false, clip * inv_denom};
}

struct AdamwScalars {
    bool  skip;
    float step_size, bc2_sqrt, decay, grad_scale;
};

static inline AdamwScalars adamw_scalars(constant AdamwArgs& a, device const float* hyper,
                                         device const float* sq, device const int* flag)
{
    if (a.device_scalars == 0) return {false, a.step_size, a.bc2_sqrt, a.decay, a.grad_scale};
    const ClipScalars c = clip_scalars(hyper, sq, flag, a.use_flag);
    return {c.skip, hyper[0], hyper[1], hyper[2], c.grad_scale};
}

// L2: Adam's decay added to the gradient (a compile-time choice: AdamW's loop stays the plain one)
template <bool L2>
static inline float adamw_step(uint i, device float* p, device const float* g, device float* m,
                               device float* v, constant AdamwArgs& a, thread const AdamwScalars& s)
{
    float gi = g[i] * s.grad_scale;
    float pi = p[i];
    if (L2)
        gi += s.decay * pi;
    else
        pi -= s.decay * pi;
    const float mi = a.beta1 * m[i] + (1.0f - a.beta1) * gi;
    const float vi = a.beta2 * v[i] + (1.0f - a.beta2) * gi * gi;
    pi -= s.step_size * precise::divide(mi, precise::divide(precise::sqrt(vi), s.bc2_sqrt) + a.eps);
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    return pi;
}

kernel void adamw_update(device float*       params [[buffer(0)]],
                         device const float* grads  [[buffer(1)]],
                         device float*       m      [[buffer(2)]],
                         device float*       v      [[buffer(3)]],
                         constant AdamwArgs& args   [[buffer(5)]],
                         device const float* hyper  [[buffer(6)]],
                         device const float* sq     [[buffer(7)]],
                         device const int*   flag   [[buffer(8)]],
                         uint gid [[thread_position_in_grid]],
                         uint gsz [[threads_per_grid]])
{
    const AdamwScalars s = adamw_scalars(args, hyper, sq, flag);
    if (s.skip) return;
    if (args.l2 != 0)
        for (uint i = gid; i < args.n; i += gsz) adamw_step<true>(i, params, grads, m, v, args, s);
    else
        for (uint i = gid; i < args.n; i += gsz) adamw_step<false>(i, params, grads, m, v, args, s);
}

template <typename W>
kernel void adamw_update_working(device float*       params  [[buffer(0)]],
                                 device const float* grads   [[buffer(1)]],
                                 device float*       m       [[buffer(2)]],
                                 device float*       v       [[buffer(3)]],
                                 device W*           working [[buffer(4)]],
                                 constant AdamwArgs& args    [[buffer(5)]],
                                 device const float* hyper   [[buffer(6)]],
                                 device const float* sq      [[buffer(7)]],
                                 device const int*   flag    [[buffer(8)]],
                                 uint gid [[thread_position_in_grid]],
                                 uint gsz [[threads_per_grid]])
{
    const AdamwScalars s = adamw_scalars(args, hyper, sq, flag);
    if (s.skip) return;
    if (args.l2 != 0)
        for (uint i = gid; i < args.n; i += gsz) working[i] = W(adamw_step<true>(i, params, grads, m, v, args, s));
    else
        for (uint i = gid; i < args.n; i += gsz) working[i] = W(adamw_step<false>(i, params, grads, m, v, args, s));
}

template [[host_name("adamw_update_working_f32")]] [[kernel]]
decltype(adamw_update_working<float>) adamw_update_working<float>;
template [[host_name("adamw_update_working_f16")]] [[kernel]]
decltype(adamw_update_working<half>) adamw_update_working<half>;
#if KRNL_BF16
template [[host_name("adamw_update_working_bf16")]] [[kernel]]
decltype(adamw_update_working<bfloat>) adamw_update_working<bfloat>;
#endif

// ---- sgd_update, sgd_update_working_{f32,f16,bf16}; lion_update, lion_update_working_*
// Buffers as adamw_update's: params, grads and buf (SGD; bound to params and never read without
// momentum) or m (Lion) at 0..2, the working copy at 4, the args at 5, hyper, sq, flag at 6..8.
// Statement order and float operations are the CPU backend's. Geometry: as adamw_update.
static inline float sgd_step(uint i, device float* p, device const float* g, device float* buf,
                             constant SgdArgs& a, float lr, float keep, float in, float gs)
{
    float gi = g[i] * gs + a.weight_decay * p[i];
    if (a.use_momentum != 0) {
        const float bi = keep != 0.0f ? keep * buf[i] + in * gi : in * gi;  // step 1 never reads buf
        buf[i] = bi;
        gi = a.nesterov != 0 ? gi + a.momentum * bi : bi;
    }
    const float pi = p[i] - lr * gi;
    p[i] = pi;
    return pi;
}

template <typename W, bool WORKING>
kernel void sgd_update(device float*       params  [[buffer(0)]],
                       device const float* grads   [[buffer(1)]],
                       device float*       buf     [[buffer(2)]],
                       device W*           working [[buffer(4)]],
                       constant SgdArgs&   args    [[buffer(5)]],
                       device const float* hyper   [[buffer(6)]],
                       device const float* sq      [[buffer(7)]],
                       device const int*   flag    [[buffer(8)]],
                       uint gid [[thread_position_in_grid]],
                       uint gsz [[threads_per_grid]])
{
    float lr = args.lr, keep = args.keep, in = args.in, gs = args.grad_scale;
    if (args.device_scalars != 0) {
        const ClipScalars c = clip_scalars(hyper, sq, flag, args.use_flag);
        if (c.skip) return;
        lr = hyper[0], keep = hyper[1], in = hyper[2], gs = c.grad_scale;
    }
    for (uint i = gid; i < args.n; i += gsz) {
        const float pi = sgd_step(i, params, grads, buf, args, lr, keep, in, gs);
        if (WORKING) working[i] = W(pi);
    }
}

static inline float sign_of(float c) { return c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f); }

template <typename W, bool WORKING>
kernel void lion_update(device float*       params  [[buffer(0)]],
                        device const float* grads   [[buffer(1)]],
                        device float*       m       [[buffer(2)]],
                        device W*           working [[buffer(4)]],
                        constant LionArgs&  args    [[buffer(5)]],
                        device const float* hyper   [[buffer(6)]],
                        device const float* sq      [[buffer(7)]],
                        device const int*   flag    [[buffer(8)]],
                        uint gid [[thread_position_in_grid]],
                        uint gsz [[threads_per_grid]])
{
    float lr = args.lr, decay = args.decay, gs = args.grad_scale;
    if (args.device_scalars != 0) {
        const ClipScalars c = clip_scalars(hyper, sq, flag, args.use_flag);
        if (c.skip) return;
        lr = hyper[0], decay = hyper[1], gs = c.grad_scale;
    }
    const float b1 = args.beta1, b2 = args.beta2;
    for (uint i = gid; i < args.n; i += gsz) {
        const float gi = grads[i] * gs;
        float pi = params[i];
        pi -= decay * pi;
        const float c = b1 * m[i] + (1.0f - b1) * gi;
        pi -= lr * sign_of(c);
        m[i] = b2 * m[i] + (1.0f - b2) * gi;
        params[i] = pi;
        if (WORKING) working[i] = W(pi);
    }
}

#define KRNL_OPTIM_KERNELS(op)                                                                            \
    template [[host_name(#op)]] [[kernel]] decltype(op<float, false>) op<float, false>;                  \
    template [[host_name(#op "_working_f32")]] [[kernel]] decltype(op<float, true>) op<float, true>;     \
    template [[host_name(#op "_working_f16")]] [[kernel]] decltype(op<half, true>) op<half, true>;
KRNL_OPTIM_KERNELS(sgd_update)
KRNL_OPTIM_KERNELS(lion_update)
#if KRNL_BF16
template [[host_name("sgd_update_working_bf16")]] [[kernel]] decltype(sgd_update<bfloat, true>) sgd_update<bfloat, true>;
template [[host_name("lion_update_working_bf16")]] [[kernel]] decltype(lion_update<bfloat, true>) lion_update<bfloat, true>;
#endif

// ---- sumsq: out[0] = sum of x^2 over x (n,), two dispatches, deterministic for a given chunk,
// groups and threadgroup size (no atomics, every sum in a fixed order), accumulated in float
// (half inputs square exactly in float).
#define RED_MAX_SIMDGROUPS 32  // 1024 threads / 32 lanes

// Sum over the threadgroup of one float per thread: simd_sum, one partial per SIMD-group in
// threadgroup memory, then thread 0 adds them in SIMD-group order. Only thread 0's result is
// meaningful. Reached by every thread of the threadgroup (it holds a barrier).
static inline float threadgroup_sum(float x, threadgroup float* part, uint tid, uint lane, uint sg, uint nsg)
{
    x = simd_sum(x);
    if (lane == 0) part[sg] = x;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    if (tid == 0)
        for (uint k = 0; k < nsg; ++k) total += part[k];
    return total;
}

// sumsq_partial: threadgroup g < groups writes partials[g] = sum of x[i]^2 over
// i in [g * chunk, min(n, (g + 1) * chunk)).
// Geometry: grid = (groups, 1, 1) threadgroups with groups = ceil(n / chunk) (extra ones return),
// any threadgroup size up to 1024; e.g. 256 threads, chunk = a multiple of 256 with
// groups <= 1024. Each thread's float chain has about chunk / threads terms.
template <typename T>
kernel void sumsq_partial(device const T*    x        [[buffer(0)]],
                          device float*      partials [[buffer(1)]],
                          constant ReduceArgs& args   [[buffer(2)]],
                          uint g    [[threadgroup_position_in_grid]],
                          uint tid  [[thread_position_in_threadgroup]],
                          uint ntg  [[threads_per_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]],
                          uint sg   [[simdgroup_index_in_threadgroup]],
                          uint nsg  [[simdgroups_per_threadgroup]])
{
    threadgroup float part[RED_MAX_SIMDGROUPS];

    if (g >= args.groups) return;  // whole threadgroup: uniform, before any barrier
    const ulong b = (ulong)g * args.chunk;
    ulong e = b + args.chunk;  // 64-bit: g * chunk may pass 2^32 on the last group
    if (e > args.n) e = args.n;
    float acc = 0.0f;
    for (ulong i = b + tid; i < e; i += ntg) {
        const float xi = float(x[i]);
        acc = fma(xi, xi, acc);
    }
    const float total = threadgroup_sum(acc, part, tid, lane, sg, nsg);
    if (tid == 0) partials[g] = total;
}

// sumsq_finish: out[0] = sum of partials[0, groups).
// Geometry: exactly one threadgroup, grid = (1, 1, 1), any threadgroup size up to 1024.
kernel void sumsq_finish(device const float* partials [[buffer(0)]],
                         device float*       out      [[buffer(1)]],
                         constant ReduceArgs& args    [[buffer(2)]],
                         uint tid  [[thread_position_in_threadgroup]],
                         uint ntg  [[threads_per_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]],
                         uint sg   [[simdgroup_index_in_threadgroup]],
                         uint nsg  [[simdgroups_per_threadgroup]])
{
    threadgroup float part[RED_MAX_SIMDGROUPS];

    float acc = 0.0f;
    for (uint k = tid; k < args.groups; k += ntg) acc += partials[k];
    const float total = threadgroup_sum(acc, part, tid, lane, sg, nsg);
    if (tid == 0) out[0] = total;
}

template [[host_name("sumsq_partial_f32")]] [[kernel]] decltype(sumsq_partial<float>) sumsq_partial<float>;
template [[host_name("sumsq_partial_f16")]] [[kernel]] decltype(sumsq_partial<half>)  sumsq_partial<half>;
#if KRNL_BF16
template [[host_name("sumsq_partial_bf16")]] [[kernel]] decltype(sumsq_partial<bfloat>) sumsq_partial<bfloat>;
#endif

// ---- adafactor_update: adafactor_rows, adafactor_cols, adafactor_stats, adafactor_unorm,
// adafactor_finish, then adafactor_apply (or adafactor_apply_working_{f32,f16,bf16}), dispatched in
// that order (kargs.h's AdafactorArgs). Buffers: params 0, grads 1, row 2, col 3, working 4, args
// 5, hyper/sq/flag 6..8, work 9. Every kernel returns at once on a non-finite step.
// Geometry: _rows and _unorm one threadgroup per row (B R threadgroups, any size up to 1024);
// _stats and _finish exactly one threadgroup; _cols and _apply grid-stride loops, any grid.
struct AdaScalars {
    bool  skip;
    float rho, w, decay, gs;
};

static inline AdaScalars ada_scalars(constant AdafactorArgs& a, device const float* hyper, device const float* sq,
                                     device const int* flag)
{
    if (a.device_scalars == 0) return {false, a.rho, a.beta2t, a.decay, a.grad_scale};
    const ClipScalars c = clip_scalars(hyper, sq, flag, a.use_flag);
    return {c.skip, hyper[0], hyper[1], hyper[2], c.grad_scale};
}

// torch.lerp's form: exact at both ends
static inline float ada_lerp(float a, float b, float w) { return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w); }

// u at (row r, column j): g / sqrt(max(row col / mean, eps1^2)), in the CPU backend's order
static inline float ada_u(uint r, uint j, device const float* g, device const float* row, device const float* col,
                          device const float* work, constant AdafactorArgs& a, float gs)
{
    const uint b = r / a.R;
    const float mean = work[2 * a.B * a.R + b];
    const float v = max(precise::divide(row[r] * col[b * a.C + j], mean), a.eps1 * a.eps1);
    return precise::divide(g[(ulong)r * a.C + j] * gs, precise::sqrt(v));
}

kernel void adafactor_rows(device const float*    params [[buffer(0)]],
                           device const float*    grads  [[buffer(1)]],
                           device float*          row    [[buffer(2)]],
                           constant AdafactorArgs& args  [[buffer(5)]],
                           device const float*    hyper  [[buffer(6)]],
                           device const float*    sq     [[buffer(7)]],
                           device const int*      flag   [[buffer(8)]],
                           device float*          work   [[buffer(9)]],
                           uint r    [[threadgroup_position_in_grid]],
                           uint tid  [[thread_position_in_threadgroup]],
                           uint ntg  [[threads_per_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint sg   [[simdgroup_index_in_threadgroup]],
                           uint nsg  [[simdgroups_per_threadgroup]])
{
    threadgroup float part_p[RED_MAX_SIMDGROUPS];
    threadgroup float part_g[RED_MAX_SIMDGROUPS];
    const AdaScalars s = ada_scalars(args, hyper, sq, flag);
    if (s.skip || r >= args.B * args.R) return;  // uniform over the threadgroup
    float pp = 0.0f, gg = 0.0f;
    for (uint j = tid; j < args.C; j += ntg) {
        const ulong i = (ulong)r * args.C + j;
        const float gi = grads[i] * s.gs;
        pp = fma(params[i], params[i], pp);
        gg = fma(gi, gi, gg);
    }
    const float tp = threadgroup_sum(pp, part_p, tid, lane, sg, nsg);
    const float tg = threadgroup_sum(gg, part_g, tid, lane, sg, nsg);
    if (tid == 0) {
        work[r] = tp;
        row[r] = ada_lerp(row[r], precise::divide(tg, float(args.C)), s.w);
    }
}

kernel void adafactor_cols(device const float*    grads [[buffer(1)]],
                           device float*          col   [[buffer(3)]],
                           constant AdafactorArgs& args [[buffer(5)]],
                           device const float*    hyper [[buffer(6)]],
                           device const float*    sq    [[buffer(7)]],
                           device const int*      flag  [[buffer(8)]],
                           uint gid [[thread_position_in_grid]],
                           uint gsz [[threads_per_grid]])
{
    const AdaScalars s = ada_scalars(args, hyper, sq, flag);
    if (s.skip) return;
    for (uint k = gid; k < args.B * args.C; k += gsz) {
        const uint b = k / args.C, j = k % args.C;
        float acc = 0.0f;
        for (uint i = 0; i < args.R; ++i) {
            const float gi = grads[((ulong)b * args.R + i) * args.C + j] * s.gs;
            acc = fma(gi, gi, acc);
        }
        col[k] = ada_lerp(col[k], precise::divide(acc, float(args.R)), s.w);
    }
}

// work[2BR + b] = max(mean(row[b]), eps1) for each entry b; work[2BR + B] = alpha.
kernel void adafactor_stats(device const float*    row   [[buffer(2)]],
                            constant AdafactorArgs& args [[buffer(5)]],
                            device const float*    hyper [[buffer(6)]],
                            device const float*    sq    [[buffer(7)]],
                            device const int*      flag  [[buffer(8)]],
                            device float*          work  [[buffer(9)]],
                            uint tid  [[thread_position_in_threadgroup]],
                            uint ntg  [[threads_per_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint sg   [[simdgroup_index_in_threadgroup]],
                            uint nsg  [[simdgroups_per_threadgroup]])
{
    threadgroup float part[RED_MAX_SIMDGROUPS];
    const AdaScalars s = ada_scalars(args, hyper, sq, flag);
    if (s.skip) return;
    const uint rows = args.B * args.R;
    float acc = 0.0f;
    for (uint k = tid; k < rows; k += ntg) acc += work[k];
    const float total = threadgroup_sum(acc, part, tid, lane, sg, nsg);
    if (tid == 0) {
        const float n = float(rows) * float(args.C);
        work[2 * rows + args.B] = max(args.eps2, precise::sqrt(precise::divide(total, n))) * s.rho;
    }
    for (uint b = 0; b < args.B; ++b) {
        threadgroup_barrier(mem_flags::mem_threadgroup);  // part is reused
        float rs = 0.0f;
        for (uint i = tid; i < args.R; i += ntg) rs += row[b * args.R + i];
        const float t = threadgroup_sum(rs, part, tid, lane, sg, nsg);
        if (tid == 0) work[2 * rows + b] = max(precise::divide(t, float(args.R)), args.eps1);
    }
}

kernel void adafactor_unorm(device const float*    grads [[buffer(1)]],
                            device const float*    row   [[buffer(2)]],
                            device const float*    col   [[buffer(3)]],
                            constant AdafactorArgs& args [[buffer(5)]],
                            device const float*    hyper [[buffer(6)]],
                            device const float*    sq    [[buffer(7)]],
                            device const int*      flag  [[buffer(8)]],
                            device float*          work  [[buffer(9)]],
                            uint r    [[threadgroup_position_in_grid]],
                            uint tid  [[thread_position_in_threadgroup]],
                            uint ntg  [[threads_per_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint sg   [[simdgroup_index_in_threadgroup]],
                            uint nsg  [[simdgroups_per_threadgroup]])
{
    threadgroup float part[RED_MAX_SIMDGROUPS];
    const AdaScalars s = ada_scalars(args, hyper, sq, flag);
    if (s.skip || r >= args.B * args.R) return;
    float uu = 0.0f;
    for (uint j = tid; j < args.C; j += ntg) {
        const float u = ada_u(r, j, grads, row, col, work, args, s.gs);
        uu = fma(u, u, uu);
    }
    const float t = threadgroup_sum(uu, part, tid, lane, sg, nsg);
    if (tid == 0) work[args.B * args.R + r] = t;
}

// work[2BR + B + 1] = alpha / max(1, rms(u) / d)
kernel void adafactor_finish(constant AdafactorArgs& args [[buffer(5)]],
                             device const float*    hyper [[buffer(6)]],
                             device const float*    sq    [[buffer(7)]],
                             device const int*      flag  [[buffer(8)]],
                             device float*          work  [[buffer(9)]],
                             uint tid  [[thread_position_in_threadgroup]],
                             uint ntg  [[threads_per_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]],
                             uint sg   [[simdgroup_index_in_threadgroup]],
                             uint nsg  [[simdgroups_per_threadgroup]])
{
    threadgroup float part[RED_MAX_SIMDGROUPS];
    const AdaScalars s = ada_scalars(args, hyper, sq, flag);
    if (s.skip) return;
    const uint rows = args.B * args.R;
    float acc = 0.0f;
    for (uint k = tid; k < rows; k += ntg) acc += work[rows + k];
    const float total = threadgroup_sum(acc, part, tid, lane, sg, nsg);
    if (tid == 0) {
        const float rms = precise::sqrt(precise::divide(total, float(rows) * float(args.C)));
        work[2 * rows + args.B + 1] = precise::divide(work[2 * rows + args.B], max(1.0f, precise::divide(rms, args.d)));
    }
}

template <typename W, bool WORKING>
kernel void adafactor_apply(device float*          params  [[buffer(0)]],
                            device const float*    grads   [[buffer(1)]],
                            device const float*    row     [[buffer(2)]],
                            device const float*    col     [[buffer(3)]],
                            device W*              working [[buffer(4)]],
                            constant AdafactorArgs& args   [[buffer(5)]],
                            device const float*    hyper   [[buffer(6)]],
                            device const float*    sq      [[buffer(7)]],
                            device const int*      flag    [[buffer(8)]],
                            device const float*    work    [[buffer(9)]],
                            uint gid [[thread_position_in_grid]],
                            uint gsz [[threads_per_grid]])
{
    const AdaScalars s = ada_scalars(args, hyper, sq, flag);
    if (s.skip) return;
    const uint rows = args.B * args.R;
    const float step = work[2 * rows + args.B + 1], keep = 1.0f - s.decay;
    for (uint i = gid; i < rows * args.C; i += gsz) {
        const float pi = params[i] * keep - step * ada_u(i / args.C, i % args.C, grads, row, col, work, args, s.gs);
        params[i] = pi;
        if (WORKING) working[i] = W(pi);
    }
}

template [[host_name("adafactor_apply")]] [[kernel]] decltype(adafactor_apply<float, false>) adafactor_apply<float, false>;
template [[host_name("adafactor_apply_working_f32")]] [[kernel]]
decltype(adafactor_apply<float, true>) adafactor_apply<float, true>;
template [[host_name("adafactor_apply_working_f16")]] [[kernel]]
decltype(adafactor_apply<half, true>) adafactor_apply<half, true>;
#if KRNL_BF16
template [[host_name("adafactor_apply_working_bf16")]] [[kernel]]
decltype(adafactor_apply<bfloat, true>) adafactor_apply<bfloat, true>;
#endif

// ---- muon_momentum (then sumsq_partial_f32, sumsq_finish over out, then muon_momentum_normalize);
// muon_update, muon_update_working_{f32,f16,bf16}. Buffers: muon_momentum grads 0, buf 1, out 2,
// args 5, hyper/sq/flag 6..8; _normalize out 2, args 5, hyper/sq/flag 6..8, the sum at 9;
// muon_update params 0, update 1, working 4, args 5, hyper/sq/flag 6..8. Grid-stride loops.
kernel void muon_momentum(device const float* grads [[buffer(0)]],
                          device float*       buf   [[buffer(1)]],
                          device float*       out   [[buffer(2)]],
                          constant MuonArgs&  args  [[buffer(5)]],
                          device const float* hyper [[buffer(6)]],
                          device const float* sq    [[buffer(7)]],
                          device const int*   flag  [[buffer(8)]],
                          uint gid [[thread_position_in_grid]],
                          uint gsz [[threads_per_grid]])
{
    float gs = args.grad_scale;
    if (args.device_scalars != 0) {
        const ClipScalars c = clip_scalars(hyper, sq, flag, args.use_flag);
        if (c.skip) return;
        gs = c.grad_scale;
    }
    const float mu = args.momentum;
    for (uint i = gid; i < args.n; i += gsz) {
        const float gi = grads[i] * gs;
        const float bi = ada_lerp(buf[i], gi, 1.0f - mu);
        buf[i] = bi;
        out[i] = args.nesterov != 0 ? ada_lerp(gi, bi, mu) : bi;
    }
}

kernel void muon_momentum_normalize(device float*       out   [[buffer(2)]],
                                    constant MuonArgs&  args  [[buffer(5)]],
                                    device const float* hyper [[buffer(6)]],
                                    device const float* sq    [[buffer(7)]],
                                    device const int*   flag  [[buffer(8)]],
                                    device const float* total [[buffer(9)]],
                                    uint gid [[thread_position_in_grid]],
                                    uint gsz [[threads_per_grid]])
{
    if (args.device_scalars != 0 && clip_scalars(hyper, sq, flag, args.use_flag).skip) return;
    const float denom = max(precise::sqrt(total[0]), args.eps);
    for (uint i = gid; i < args.n; i += gsz) out[i] = precise::divide(out[i], denom);
}

template <typename W, bool WORKING>
kernel void muon_update(device float*             params  [[buffer(0)]],
                        device const float*       update  [[buffer(1)]],
                        device W*                 working [[buffer(4)]],
                        constant MuonUpdateKArgs& args    [[buffer(5)]],
                        device const float*       hyper   [[buffer(6)]],
                        device const float*       sq      [[buffer(7)]],
                        device const int*         flag    [[buffer(8)]],
                        uint gid [[thread_position_in_grid]],
                        uint gsz [[threads_per_grid]])
{
    float lr = args.lr, decay = args.decay;
    if (args.device_scalars != 0) {
        if (clip_scalars(hyper, sq, flag, args.use_flag).skip) return;
        lr = hyper[0], decay = hyper[2];
    }
    const float step = lr * args.scale, keep = 1.0f - decay;
    for (uint i = gid; i < args.n; i += gsz) {
        const float pi = params[i] * keep - step * update[i];
        params[i] = pi;
        if (WORKING) working[i] = W(pi);
    }
}

KRNL_OPTIM_KERNELS(muon_update)
#if KRNL_BF16
template [[host_name("muon_update_working_bf16")]] [[kernel]] decltype(muon_update<bfloat, true>) muon_update<bfloat, true>;
#endif

// ---- adamw8bit_update, adamw8bit_update_working_{f32,f16,bf16}: bitsandbytes' 8-bit blockwise
// AdamW over one parameter. One threadgroup of exactly 256 threads per block of 256 elements
// (grid = ceil(n / 256) threadgroups): dequantize, the AdamW step, then the block's absmax and
// each element's code (kargs.h's Adamw8bitArgs). Buffers: params 0, grads 1, m_codes 2,
// v_codes 3 (i32 words of four codes), working 4, args 5, hyper/sq/flag 6..8, m_absmax 9,
// v_absmax 10, m_map 11, v_map 12.

// the code of x in a sorted 256-entry map: how many midpoints lie below x (bucketize's count)
static inline uint map_code(float x, device const float* map)
{
    uint lo = 0, hi = 255;  // the answer lies in [lo, hi]
    while (lo < hi) {
        const uint mid = (lo + hi) / 2;
        if ((map[mid] + map[mid + 1]) / 2.0f < x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// code of x in its block of absmax amax, bitsandbytes' way: a full block multiplies by the
// reciprocal, a partial one divides
static inline uint quantize8(float x, float amax, bool full, device const float* map)
{
    const float am = max(amax, 1e-38f);
    const float s = min(1.0f, max(-1.0f, full ? x * precise::divide(1.0f, am) : precise::divide(x, am)));
    return map_code(s, map);
}

// the block's max of |x| over the threadgroup, to every thread
static inline float threadgroup_absmax(float x, threadgroup float* part, threadgroup float* out, uint tid, uint lane,
                                       uint sg, uint nsg)
{
    x = simd_max(max(x, -x));  // |x|
    if (lane == 0) part[sg] = x;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
        float m = 0.0f;
        for (uint k = 0; k < nsg; ++k) m = max(m, part[k]);
        out[0] = m;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    return out[0];
}

template <typename W, bool WORKING>
kernel void adamw8bit_update(device float*       params   [[buffer(0)]],
                             device const float* grads    [[buffer(1)]],
                             device uint*        m_codes  [[buffer(2)]],
                             device uint*        v_codes  [[buffer(3)]],
                             device W*           working  [[buffer(4)]],
                             constant Adamw8bitArgs& args [[buffer(5)]],
                             device const float* hyper    [[buffer(6)]],
                             device const float* sq       [[buffer(7)]],
                             device const int*   flag     [[buffer(8)]],
                             device float*       m_absmax [[buffer(9)]],
                             device float*       v_absmax [[buffer(10)]],
                             device const float* m_map    [[buffer(11)]],
                             device const float* v_map    [[buffer(12)]],
                             uint b    [[threadgroup_position_in_grid]],
                             uint tid  [[thread_position_in_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]],
                             uint sg   [[simdgroup_index_in_threadgroup]],
                             uint nsg  [[simdgroups_per_threadgroup]])
{
    threadgroup float part[RED_MAX_SIMDGROUPS];
    threadgroup float amax[2];
    threadgroup uint  mq[256];
    threadgroup uint  vq[256];
    float step_size = args.step_size, bc2_sqrt = args.bc2_sqrt, decay = args.decay, gs = args.grad_scale;
    bool skip = false;
    if (args.device_scalars != 0) {
        const ClipScalars c = clip_scalars(hyper, sq, flag, args.use_flag);
        skip = c.skip, step_size = hyper[0], bc2_sqrt = hyper[1], decay = hyper[2], gs = c.grad_scale;
    }
    const uint i0 = b * 256;
    if (skip || i0 >= args.n) return;  // uniform over the threadgroup
    const uint len = min(256u, args.n - i0), i = i0 + tid;
    const bool on = tid < len;
    float mi = 0.0f, vi = 0.0f;
    if (on) {
        const uint mc = (m_codes[i / 4] >> (8 * (i % 4))) & 0xffu, vc = (v_codes[i / 4] >> (8 * (i % 4))) & 0xffu;
        const float gi = grads[i] * gs;
        float pi = params[i] * (1.0f - decay);
        mi = fma(args.c1, gi, args.beta1 * (m_map[mc] * m_absmax[b]));
        vi = args.beta2 * (v_map[vc] * v_absmax[b]) + args.c2 * gi * gi;
        pi -= step_size * precise::divide(mi, precise::divide(precise::sqrt(vi), bc2_sqrt) + args.eps);
        params[i] = pi;
        if (WORKING) working[i] = W(pi);
    }
    const float ma = threadgroup_absmax(mi, part, amax, tid, lane, sg, nsg);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // part and amax[0] are reused
    const float va = threadgroup_absmax(vi, part, amax + 1, tid, lane, sg, nsg);
    const bool full = len == 256;
    mq[tid] = on ? quantize8(mi, ma, full, m_map) : 0u;
    vq[tid] = on ? quantize8(vi, va, full, v_map) : 0u;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < (len + 3) / 4) {
        const uint k = 4 * tid;
        m_codes[i0 / 4 + tid] = mq[k] | (mq[k + 1] << 8) | (mq[k + 2] << 16) | (mq[k + 3] << 24);
        v_codes[i0 / 4 + tid] = vq[k] | (vq[k + 1] << 8) | (vq[k + 2] << 16) | (vq[k + 3] << 24);
    }
    if (tid == 0) {
        m_absmax[b] = full ? ma : max(ma, 1e-38f);
        v_absmax[b] = full ? va : max(va, 1e-38f);
    }
}

KRNL_OPTIM_KERNELS(adamw8bit_update)
#if KRNL_BF16
template [[host_name("adamw8bit_update_working_bf16")]] [[kernel]]
decltype(adamw8bit_update<bfloat, true>) adamw8bit_update<bfloat, true>;
#endif

// ---- nonfinite: flag[0] = 1 if any of x[0, n) is inf or NaN; never cleared here (the host
// zeroes it once per step, so several tensors can share one flag). Tested on the raw bits
// (exponent all ones), which fast math cannot fold away as it may isinf/isnan. Only args.n is
// used; chunk and groups are ignored.
// Geometry: a grid-stride loop, any grid; e.g. 256 threads per threadgroup and
// min(ceil(n / 256), 1024) threadgroups. All writers store the same value 1, atomically.
template <typename U, uint EXP>
kernel void nonfinite(device const U*      x    [[buffer(0)]],
                      device atomic_int*   flag [[buffer(1)]],
                      constant ReduceArgs& args [[buffer(2)]],
                      uint gid  [[thread_position_in_grid]],
                      uint gsz  [[threads_per_grid]],
                      uint lane [[thread_index_in_simdgroup]])
{
    bool bad = false;
    for (uint i = gid; i < args.n; i += gsz) bad |= (uint(x[i]) & EXP) == EXP;
    // one store per SIMD-group at most (every lane reaches simd_any: no early return above)
    if (simd_any(bad) && lane == 0) atomic_store_explicit(flag, 1, memory_order_relaxed);
}

template [[host_name("nonfinite_f32")]] [[kernel]] decltype(nonfinite<uint, 0x7f800000u>) nonfinite<uint, 0x7f800000u>;
template [[host_name("nonfinite_f16")]] [[kernel]] decltype(nonfinite<ushort, 0x7c00u>)   nonfinite<ushort, 0x7c00u>;
// bf16 has f32's 8-bit exponent: the same ushort test with its mask (no bfloat type needed, but
// kept with the other bf16 kernels so that a library without bf16 has none of them)
#if KRNL_BF16
template [[host_name("nonfinite_bf16")]] [[kernel]] decltype(nonfinite<ushort, 0x7f80u>) nonfinite<ushort, 0x7f80u>;
#endif
