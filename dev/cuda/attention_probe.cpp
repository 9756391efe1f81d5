// Times every engine cuDNN offers for the causal attention of the train benchmark's 1b and 8b
// shapes (krnl bench --workloads train), forward and backward, in the layout krnl passes
// (token-major: q, k, v column blocks of the (B, T, (Hq + 2 Hkv) D) qkv projection, o and dq/dk/dv
// likewise) and in the head-major contiguous (B, H, T, D) layout for comparison. Standalone: it
// needs the CUDA runtime, cudnn.h and the header-only cuDNN frontend where it is compiled, and
// opens libcudnn at run time (as csrc/cuda/attention_cudnn.cpp does).
//
//   g++ -O2 -std=c++17 -DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING -I<frontend>/include -I<cudnn>/include
//       -I<nvrtc>/include -I$CUDA/include -o attention_probe dev/cuda/attention_probe.cpp
//       -L$CUDA/lib64 -lcudart -ldl
//   ./attention_probe /path/libcudnn.so.9 > table.txt
//
// A line per (shape, layout, direction, implementation, heuristics mode, plan): the plan's name,
// the median of 20 timed calls after 3 warm-ups, TFLOP/s (causal: half the square), and whether
// 3 repeats gave the same bits (det=).
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <cudnn_frontend.h>

#include "cuda_check.h"

namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}
namespace fe = cudnn_frontend;

struct Dims {
  int64_t B, H, T, D, sb, sh, st;
};

struct Shape {
  const char* name;
  int64_t B, T, Hq, Hkv, D;
};

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

static fe::graph::Tensor_attributes& place(fe::graph::Tensor_attributes& t, int64_t uid, const Dims& d) {
  return t.set_uid(uid).set_dim({d.B, d.H, d.T, d.D}).set_stride({d.sb, d.sh, d.st, 1});
}

static fe::graph::Tensor_attributes& place_stats(fe::graph::Tensor_attributes& t, const Dims& q) {
  return t.set_uid(kStats).set_dim({q.B, q.H, q.T, 1}).set_stride({q.H * q.T, q.T, 1, 1}).set_data_type(
      fe::DataType_t::FLOAT);
}

static std::shared_ptr<fe::graph::Graph> make_graph(bool backward, const std::vector<Dims>& ops, float scale,
                                                    int impl, bool deterministic) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto in = [&](const char* n, int64_t uid, const Dims& d) {
    fe::graph::Tensor_attributes t;
    place(t.set_name(n), uid, d);
    return g->tensor(t);
  };
  auto q = in("q", kQ, ops[0]);
  auto k = in("k", kK, ops[1]);
  auto v = in("v", kV, ops[2]);
  if (!backward) {
    auto opts = fe::graph::SDPA_attributes().set_name("fwd").set_generate_stats(true).set_attn_scale(scale);
    opts.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
    if (impl == 1) opts.set_implementation(fe::AttentionImplementation_t::COMPOSITE);
    if (impl == 2) opts.set_implementation(fe::AttentionImplementation_t::UNIFIED);
    auto [o, lse] = g->sdpa(q, k, v, opts);
    place(o->set_output(true), kO, ops[3]);
    place_stats(lse->set_output(true), ops[0]);
  } else {
    auto o = in("o", kO, ops[3]);
    auto dO = in("dout", kDO, ops[4]);
    fe::graph::Tensor_attributes st;
    auto lse = g->tensor(place_stats(st.set_name("lse"), ops[0]));
    auto opts = fe::graph::SDPA_backward_attributes().set_name("bwd").set_attn_scale(scale);
    opts.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
    if (deterministic) opts.set_deterministic_algorithm(true);
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dO, lse, opts);
    place(dq->set_output(true), kDQ, ops[5]);
    place(dk->set_output(true), kDK, ops[6]);
    place(dv->set_output(true), kDV, ops[7]);
  }
  return g;
}

// Operand views: token-major column blocks of one (B, T, W) buffer, or head-major contiguous.
static Dims token_major(const Shape& s, int64_t heads, int64_t width) {
  return {s.B, heads, s.T, s.D, s.T * width, s.D, width};
}
static Dims head_major(const Shape& s, int64_t heads) {
  return {s.B, heads, s.T, s.D, heads * s.T * s.D, s.T * s.D, s.D};
}

static uint64_t checksum(const void* dev, size_t bytes) {
  std::vector<uint64_t> h(bytes / 8);
  CK(cudaMemcpy(h.data(), dev, h.size() * 8, cudaMemcpyDeviceToHost));
  uint64_t c = 1469598103934665603ull;
  for (uint64_t w : h) c = (c ^ w) * 1099511628211ull;
  return c;
}

int main(int argc, char** argv) {
  const char* lib = argc > 1 ? argv[1] : "libcudnn.so.9";
  fe::cudnn_dlhandle = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (!fe::cudnn_dlhandle) {
    fprintf(stderr, "cannot open %s: %s\n", lib, dlerror());
    return 1;
  }
  // NVRTC before cuDNN compiles an engine (as attention_cudnn.cpp preloads it)
  for (const char* n : {"libnvrtc.so.13", "libnvrtc.so.12", "/usr/local/cuda/lib64/libnvrtc.so.13"})
    if (dlopen(n, RTLD_NOW | RTLD_LOCAL)) break;
  cudnnHandle_t handle;
  if (fe::detail::create_handle(&handle) != CUDNN_STATUS_SUCCESS) {
    fprintf(stderr, "cudnnCreate failed\n");
    return 1;
  }
  printf("cuDNN %zu, frontend %d\n", fe::detail::get_backend_version(), CUDNN_FRONTEND_VERSION);
  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  fe::detail::set_stream(handle, stream);

  void* ws = nullptr;
  const Shape shapes[] = {{"1b", 4, 2048, 32, 8, 64}, {"8b", 2, 4096, 32, 8, 128}};
  for (const Shape& s : shapes) {
    const int64_t W = (s.Hq + 2 * s.Hkv) * s.D, C = s.Hq * s.D;
    const size_t n_qkv = size_t(s.B * s.T * W), n_o = size_t(s.B * s.T * C);
    // buffers: qkv, o, dout, dqkv (token-major; head-major uses the same memory, other strides)
    void *qkv, *o, *dout, *dqkv, *lse;
    CK(cudaMalloc(&qkv, n_qkv * 2));
    CK(cudaMalloc(&o, n_o * 2));
    CK(cudaMalloc(&dout, n_o * 2));
    CK(cudaMalloc(&dqkv, n_qkv * 2));
    CK(cudaMalloc(&lse, size_t(s.B * s.Hq * s.T) * 4));
    {  // random signs, exponents 2^-7..2^0 and mantissas, so softmax is not degenerate
      std::vector<uint16_t> h(std::max(n_qkv, n_o));
      uint32_t r = 12345;
      for (auto& x : h) {
        r = r * 1664525u + 1013904223u;
        x = uint16_t(0x3c00 + ((r >> 16) & 0x3ff)) ^ ((r & 0x8000) ? 0x8000 : 0);
      }
      CK(cudaMemcpy(qkv, h.data(), n_qkv * 2, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dout, h.data(), n_o * 2, cudaMemcpyHostToDevice));
    }
    const double flops_fwd = 4.0 * s.B * s.Hq * double(s.T) * s.T * s.D / 2;
    const float scale = 1.0f / std::sqrt(float(s.D));
    for (int layout = 0; layout < 2; ++layout) {
      char* q = (char*)qkv;
      char *k = q + (layout ? n_o * 2 : C * 2), *v = k + (layout ? size_t(s.B * s.T * s.Hkv * s.D) * 2 : s.Hkv * s.D * 2);
      char* dq = (char*)dqkv;
      char *dk = dq + (layout ? n_o * 2 : C * 2),
           *dv = dk + (layout ? size_t(s.B * s.T * s.Hkv * s.D) * 2 : s.Hkv * s.D * 2);
      Dims dq_ = layout ? head_major(s, s.Hq) : token_major(s, s.Hq, W);
      Dims dkv = layout ? head_major(s, s.Hkv) : token_major(s, s.Hkv, W);
      Dims do_ = layout ? head_major(s, s.Hq) : token_major(s, s.Hq, C);
      for (int backward = 0; backward < 2; ++backward) {
        std::vector<Dims> ops = {dq_, dkv, dkv, do_};
        if (backward) ops.insert(ops.end(), {do_, dq_, dkv, dkv});
        std::unordered_map<int64_t, void*> pack{{kQ, q}, {kK, k}, {kV, v}, {kO, o}, {kStats, lse}};
        if (backward) pack.insert({{kDO, dout}, {kDQ, dq}, {kDK, dk}, {kDV, dv}});
        for (int impl = 0; impl < 3; ++impl) {
          if (backward && impl) continue;  // the backward has no implementation choice
          for (int det = 0; det < (backward ? 2 : 1); ++det) {
            for (auto mode : {fe::HeurMode_t::A, fe::HeurMode_t::B}) {
              auto g = make_graph(backward, ops, scale, impl, det);
              auto e = g->validate();
              if (e.is_good()) e = g->build_operation_graph(handle);
              if (e.is_good()) e = g->create_execution_plans({mode});
              if (e.is_good()) e = g->check_support(handle);
              if (e.is_good()) e = g->build_plans(handle, fe::BuildPlanPolicy_t::ALL);
              const char* dir = backward ? "bwd" : "fwd";
              const char* lay = layout ? "head-major" : "token-major";
              const char* im = impl == 0 ? "auto" : impl == 1 ? "composite" : "unified";
              const char* md = mode == fe::HeurMode_t::A ? "A" : "B";
              if (!e.is_good()) {
                printf("%s %s %s impl=%s det=%d heur=%s: no plan: %s\n", s.name, lay, dir, im, det, md,
                       e.get_message().c_str());
                continue;
              }
              const int64_t n = g->get_execution_plan_count();
              for (int64_t i = 0; i < n; ++i) {
                std::string name;
                (void)g->get_plan_name_at_index(i, name);
                int64_t wsz = 0;
                if (!g->get_workspace_size_plan_at_index(i, wsz).is_good()) continue;
                if (ws) CK(cudaFree(ws));
                ws = nullptr;
                if (wsz) CK(cudaMalloc(&ws, wsz));
                bool ok = true;
                for (int w = 0; w < 3 && ok; ++w) ok = g->execute_plan_at_index(handle, pack, ws, i).is_good();
                if (!ok) {
                  printf("%s %s %s impl=%s det=%d heur=%s plan %ld %s: execute failed\n", s.name, lay, dir, im,
                         det, md, long(i), name.c_str());
                  continue;
                }
                CK(cudaStreamSynchronize(stream));
                std::vector<float> t;
                cudaEvent_t a, b;
                CK(cudaEventCreate(&a));
                CK(cudaEventCreate(&b));
                for (int r = 0; r < 20; ++r) {
                  CK(cudaEventRecord(a, stream));
                  (void)g->execute_plan_at_index(handle, pack, ws, i);
                  CK(cudaEventRecord(b, stream));
                  CK(cudaEventSynchronize(b));
                  float ms;
                  CK(cudaEventElapsedTime(&ms, a, b));
                  t.push_back(ms);
                }
                std::sort(t.begin(), t.end());
                uint64_t c0 = 0;
                bool same = true;
                for (int r = 0; r < 3; ++r) {
                  (void)g->execute_plan_at_index(handle, pack, ws, i);
                  CK(cudaStreamSynchronize(stream));
                  uint64_t c = backward ? checksum(dqkv, n_qkv * 2) : checksum(o, n_o * 2);
                  if (r == 0) c0 = c;
                  same = same && c == c0;
                }
                const double fl = flops_fwd * (backward ? 2.5 : 1.0);
                printf("%s %s %s impl=%s det=%d heur=%s plan %ld %-40s ws %8ld KiB  %8.1f us  %6.1f TFLOP/s  det=%s\n",
                       s.name, lay, dir, im, det, md, long(i), name.c_str(), long(wsz / 1024), t[10] * 1e3,
                       fl / (t[10] * 1e-3) / 1e12, same ? "yes" : "NO");
                fflush(stdout);
                cudaEventDestroy(a);
                cudaEventDestroy(b);
              }
            }
          }
        }
      }
    }
    cudaFree(qkv);
    cudaFree(o);
    cudaFree(dout);
    cudaFree(dqkv);
    cudaFree(lse);
  }
  if (ws) cudaFree(ws);
  return 0;
}
