// Host-side check of the CUDA grouped GEMMs' index arithmetic (csrc/cuda/moe_tiles.cuh) and of the
// sort's and tile map's algorithms (csrc/cuda/moe.cu, moe_gemm.cuh), for machines with nvcc but no
// GPU (tests/test_cuda_host.py builds and runs it). Each block of a launch is emulated thread by
// thread with the kernels' own helpers: block_tile, operands, the loaders' fetch and commit into
// double-buffered shared tiles (and, for 16-byte units, their copy, the cp.async kernel's, landing
// the same tiles), WMMA's documented fragment layouts at WarpTiles' offsets (or
// ThreadTiles' products), then the epilogue's lane mapping and out_index. Small integers keep every
// product exact, so the emulation must equal the reference exactly, and every output element must
// be written once. moe_quantized_matmul's dequantizing B loader (QuantTileLoader: codes that
// straddle words, runs from bit 16 of a word, groups changing inside a step, rounding to bf16 or
// f16; mode mxfp4's E2M1 codes too) runs the same way against codes packed here bit by bit and
// dequantized independently; its scales (quarters) and small biases keep the dequantized, rounded
// weights on a grid where every sum stays exact. The sort and the tile map are mirrored line by line (warps as loops over 32
// lanes, __match_any_sync as a scan of the lanes), which checks their arithmetic, not the CUDA
// itself: nothing here runs on a GPU.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/moe_tiles.cuh"

using namespace krnl::cuda::moe;

namespace {

int failures = 0;
#define CHECK(cond, ...)                      \
  do {                                        \
    if (!(cond)) {                            \
      if (++failures <= 20) {                 \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
        std::printf(__VA_ARGS__);             \
        std::printf("\n");                    \
      }                                       \
    }                                         \
  } while (0)

uint16_t bf16_bits(float f) {  // exact for the small integers used here
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t(u >> 16);
}
float elem_f(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float elem_f(float f) { return f; }

// A tile element as float: 16-bit elements hold DT's bits.
template <krnl::DType DT>
float to_f(uint16_t b) {
  return DT == krnl::DType::f16 ? krnl::f16_to_f32(b) : krnl::bf16_to_f32(b);
}
template <krnl::DType DT>
float to_f(float f) {
  return f;
}
template <krnl::DType DT>
uint16_t from_f(float f) {
  return DT == krnl::DType::f16 ? krnl::f32_to_f16(f) : krnl::f32_to_bf16(f);
}

// moe_tile_map_kernel, a warp as 32 lanes.
std::vector<int4> tile_map(const std::vector<int32_t>& off, int E, int P, int BM, int T) {
  std::vector<int4> map(size_t(T), make_int4(-7, -7, -7, -7));
  const int per = (E + 31) / 32;
  auto range = [&](int e, int& lo, int& hi) {
    lo = std::min(std::max(off[size_t(e)], 0), P);
    hi = std::min(std::max(off[size_t(e) + 1], lo), P);
    return (hi - lo + BM - 1) / BM;
  };
  int mine[32], inc[32];
  for (int lane = 0; lane < 32; ++lane) {
    const int e0 = std::min(E, lane * per), e1 = std::min(E, e0 + per);
    int lo, hi;
    mine[lane] = 0;
    for (int e = e0; e < e1; ++e) mine[lane] += range(e, lo, hi);
  }
  for (int lane = 0; lane < 32; ++lane) inc[lane] = mine[lane] + (lane ? inc[lane - 1] : 0);
  for (int lane = 0; lane < 32; ++lane) {
    const int e0 = std::min(E, lane * per), e1 = std::min(E, e0 + per);
    int at = inc[lane] - mine[lane], lo, hi;
    for (int e = e0; e < e1; ++e) {
      const int n = range(e, lo, hi);
      for (int j = 0; j < n; ++j, ++at)
        if (at < T) map[size_t(at)] = make_int4(e, lo + j * BM, std::min(BM, hi - lo - j * BM), 0);
    }
  }
  for (int t = std::min(inc[31], T); t < T; ++t) map[size_t(t)] = make_int4(-1, 0, 0, 0);
  return map;
}

// Emulates every block of one grouped GEMM launch into out (float), counting writes per element.
// 16-bit elements hold DT's bits. BITS > 0: B is the quantized W of q (moe_quantized_matmul).
template <Mode MODE, int BM, int BN, int BK, int ES, bool VEC, bool TC,
          krnl::DType DT = ES == 2 ? krnl::DType::bf16 : krnl::DType::f32, int BITS = 0, int WARPS_M = 2>
void emulate(const GemmParams& p, int64_t blocks, std::vector<float>& out, std::vector<int>& writes,
             const QuantParams& q = QuantParams{}) {
  using G = Geometry<MODE, BM, BN, BK, ES>;
  using E = Elem<ES>;
  constexpr int NT = 256;
  using LA = TileLoader<G::A_ROWS, G::A_COLS, G::LDA, ES, NT, VEC>;
  using LB = std::conditional_t<BITS == 0, TileLoader<G::B_ROWS, G::B_COLS, G::LDB, ES, NT, VEC>,
                                QuantTileLoader<G::B_ROWS, G::B_COLS, G::LDB, DT, NT, BITS>>;
  auto val = [](E v) { return to_f<DT>(v); };
  std::vector<E> As(size_t(2 * G::A_TILE)), Bs(size_t(2 * G::B_TILE));
  std::vector<LA> la(NT);
  std::vector<LB> lb(NT);
  for (int64_t b = 0; b < blocks; ++b) {
    const BlockTile t = block_tile<MODE, BM, BN>(p, b);
    if (!t.live) continue;
    const E *A, *B;
    operands<MODE>(p, t, A, B);
    const QuantParams qe = quant_operand(q, t.e, MODE == Mode::linear ? p.N : p.K);
    int64_t fetched = 0;  // the k0 of the tiles fetched last
    auto fetch = [&](int tid, int64_t k0) {
      fetched = k0;
      if constexpr (BITS == 0)
        fetch_step<MODE>(la[size_t(tid)], lb[size_t(tid)], tid, A, B, p, t, k0);
      else
        fetch_step_q<MODE>(la[size_t(tid)], lb[size_t(tid)], tid, A, qe, p, t, k0);
    };
    std::vector<float> acc(size_t(BM * BN), 0.f);  // (row, col) of the block's tile
    std::fill(As.begin(), As.end(), E(0x5555));     // junk: a tile element never committed shows up
    std::fill(Bs.begin(), Bs.end(), E(0x5555));
    const int64_t steps = (t.kext + BK - 1) / BK;
    auto commit = [&](int buf) {
      for (int tid = 0; tid < NT; ++tid) la[size_t(tid)].commit(tid, As.data() + buf * G::A_TILE);
      for (int tid = 0; tid < NT; ++tid) lb[size_t(tid)].commit(tid, Bs.data() + buf * G::B_TILE);
      if constexpr (BITS == 0 && VEC) {  // the cp.async kernel's copy lands the very same tiles
        std::vector<E> ac(size_t(G::A_TILE), E(0x5555)), bc(size_t(G::B_TILE), E(0x5555));
        for (int tid = 0; tid < NT; ++tid)
          copy_step<MODE>(la[size_t(tid)], lb[size_t(tid)], tid, A, B, p, t, fetched, ac.data(), bc.data());
        CHECK(std::equal(ac.begin(), ac.end(), As.begin() + buf * G::A_TILE), "copy's A tile differs at k0 %lld",
              (long long)fetched);
        CHECK(std::equal(bc.begin(), bc.end(), Bs.begin() + buf * G::B_TILE), "copy's B tile differs at k0 %lld",
              (long long)fetched);
      }
    };
    if (steps > 0) {
      for (int tid = 0; tid < NT; ++tid) fetch(tid, 0);
      commit(0);
    }
    for (int64_t s = 0; s < steps; ++s) {
      const int buf = int(s & 1);
      if (s + 1 < steps)
        for (int tid = 0; tid < NT; ++tid) fetch(tid, (s + 1) * BK);
      const E* as = As.data() + buf * G::A_TILE;
      const E* bs = Bs.data() + buf * G::B_TILE;
      if constexpr (TC) {
        using WT = WarpTiles<G, WARPS_M>;
        for (int w = 0; w < 8; ++w)
          for (int kk = 0; kk < BK; kk += 16)
            for (int i = 0; i < WT::FM; ++i)
              for (int j = 0; j < WT::FN; ++j) {
                const int ao = WT::a_frag(w, i, kk), bo = WT::b_frag(w, j, kk);
                CHECK(ao % 16 == 0 && bo % 16 == 0, "fragment offsets %d %d not 32-byte aligned", ao, bo);
                for (int r = 0; r < 16; ++r)
                  for (int c = 0; c < 16; ++c) {
                    float sum = 0.f;
                    for (int k = 0; k < 16; ++k) {
                      // WMMA: A row_major (r, k) at r ldm + k, col_major at r + k ldm; B row_major
                      // (k, c) at k ldm + c, col_major at k + c ldm.
                      const int ai = G::A_KM ? ao + r + k * G::LDA : ao + r * G::LDA + k;
                      const int bi = G::B_NK ? bo + k + c * G::LDB : bo + k * G::LDB + c;
                      CHECK(ai >= 0 && ai < G::A_TILE && bi >= 0 && bi < G::B_TILE, "fragment outside its tile");
                      sum += val(as[ai]) * val(bs[bi]);
                    }
                    acc[size_t((WT::frag_row(w, i) + r) * BN + WT::frag_col(w, j) + c)] += sum;
                  }
              }
      } else {
        using TT = ThreadTiles;
        for (int tid = 0; tid < NT; ++tid)
          for (int k = 0; k < BK; ++k)
            for (int i = 0; i < TT::TM; ++i)
              for (int j = 0; j < TT::TN; ++j)
                acc[size_t(TT::row(tid, i) * BN + TT::col(tid, j))] +=
                    val(as[G::a_at(TT::row(tid, i), k)]) * val(bs[G::b_at(k, TT::col(tid, j))]);
      }
      if (s + 1 < steps) commit(buf ^ 1);
    }
    const bool empty = t.kext == 0;
    auto put = [&](int r, int c, float a) {
      const int64_t o = out_index(t, p.N, r, c);
      if (o < 0) return;
      CHECK(o < int64_t(out.size()), "output index %lld outside", (long long)o);
      const float v = empty ? 0.f : p.alpha * a;
      out[size_t(o)] = p.beta != 0.f ? p.beta * out[size_t(o)] + v : v;
      ++writes[size_t(o)];
    };
    if constexpr (TC) {
      using WT = WarpTiles<G, WARPS_M>;
      std::vector<float> scr(size_t(WT::EPI_FLOATS));
      for (int w = 0; w < 8; ++w)
        for (int i = 0; i < WT::FM; ++i)
          for (int j = 0; j < WT::FN; ++j) {
            const int fr = WT::frag_row(w, i), fc = WT::frag_col(w, j);
            for (int r = 0; r < 16; ++r)  // store_matrix_sync, row-major, ldm EPI_LD
              for (int c = 0; c < 16; ++c) scr[size_t(r * WT::EPI_LD + c)] = acc[size_t((fr + r) * BN + fc + c)];
            int seen[16][16] = {};
            for (int lane = 0; lane < 32; ++lane) {
              if (VEC) {
                int r, c;
                WT::epi_vec(lane, r, c);
                // the kernel tests column c alone: the 8 columns must agree
                const bool in = out_index(t, p.N, fr + r, fc + c) >= 0;
                for (int q = 0; q < 8; ++q) {
                  CHECK((out_index(t, p.N, fr + r, fc + c + q) >= 0) == in, "an 8-column group straddles N");
                  ++seen[r][c + q];
                  if (in) put(fr + r, fc + c + q, scr[size_t(r * WT::EPI_LD + c + q)]);
                }
              } else {
                for (int q = 0; q < 8; ++q) {
                  int r, c;
                  WT::epi_scalar(lane, q, r, c);
                  ++seen[r][c];
                  put(fr + r, fc + c, scr[size_t(r * WT::EPI_LD + c)]);
                }
              }
            }
            for (int r = 0; r < 16; ++r)
              for (int c = 0; c < 16; ++c)
                CHECK(seen[r][c] == 1, "epilogue covers (%d, %d) %d times", r, c, seen[r][c]);
          }
    } else {
      using TT = ThreadTiles;
      for (int tid = 0; tid < NT; ++tid)
        for (int i = 0; i < TT::TM; ++i)
          for (int j = 0; j < TT::TN; ++j)
            put(TT::row(tid, i), TT::col(tid, j), acc[size_t(TT::row(tid, i) * BN + TT::col(tid, j))]);
    }
  }
}

// Random rows per expert (some experts empty), as moe_sort's offsets.
std::vector<int32_t> random_offsets(std::mt19937& rng, int E, int P) {
  std::vector<int32_t> cnt(size_t(E), 0);
  const int hot = int(rng() % unsigned(E));
  for (int i = 0; i < P; ++i) {
    const int e = rng() % 3 == 0 ? hot : int(rng() % unsigned(E));
    if (E > 2 && e == (hot + 1) % E) {  // keep one expert empty
      ++cnt[size_t(hot)];
      continue;
    }
    ++cnt[size_t(e)];
  }
  std::vector<int32_t> off(size_t(E) + 1, 0);
  for (int e = 0; e < E; ++e) off[size_t(e) + 1] = off[size_t(e)] + cnt[size_t(e)];
  return off;
}

template <int ES>
std::vector<Elem<ES>> random_matrix(std::mt19937& rng, size_t n) {
  std::vector<Elem<ES>> v(n);
  for (auto& x : v) {
    const float f = float(int(rng() % 9) - 4);
    if constexpr (ES == 2)
      x = bf16_bits(f);
    else
      x = f;
  }
  return v;
}

// One moe_gemm (linear or input_grad) configuration against the reference.
template <Mode MODE, int BM, int BN, int BK, int ES, bool VEC, bool TC, int WARPS_M = 2>
void check_forward(std::mt19937& rng, int E, int P, int O, int I, float beta) {
  constexpr bool LIN = MODE == Mode::linear;
  const int K = LIN ? I : O, N = LIN ? O : I;
  const std::vector<int32_t> off = random_offsets(rng, E, P);
  const auto x = random_matrix<ES>(rng, size_t(P) * K);
  const auto w = random_matrix<ES>(rng, size_t(E) * O * I);
  std::vector<float> out(size_t(P) * N), ref;
  for (auto& o : out) o = float(int(rng() % 7) - 3);
  ref = out;
  const float alpha = 1.5f;
  for (int e = 0; e < E; ++e)
    for (int r = off[size_t(e)]; r < off[size_t(e) + 1]; ++r)
      for (int n = 0; n < N; ++n) {
        float s = 0.f;
        for (int k = 0; k < K; ++k)
          s += elem_f(x[size_t(r) * K + k]) *
               elem_f(LIN ? w[(size_t(e) * O + n) * I + k] : w[(size_t(e) * O + k) * I + n]);
        float& o = ref[size_t(r) * N + n];
        o = beta != 0.f ? beta * o + alpha * s : alpha * s;
      }
  const int T = (P + BM - 1) / BM + E;
  const std::vector<int4> map = tile_map(off, E, P, BM, T);
  const int64_t tiles_n = (N + BN - 1) / BN;
  GemmParams p{x.data(), w.data(), out.data(), map.data(), off.data(), P, 0, N, K, int64_t(O) * I, 0, tiles_n,
               krnl::DType::f32, alpha, beta};
  std::vector<int> writes(out.size(), 0);
  emulate<MODE, BM, BN, BK, ES, VEC, TC, ES == 2 ? krnl::DType::bf16 : krnl::DType::f32, 0, WARPS_M>(
      p, T * tiles_n, out, writes);
  int bad = 0;
  for (size_t i = 0; i < out.size(); ++i)
    if (out[i] != ref[i] || writes[i] != 1) ++bad;
  CHECK(bad == 0, "moe_gemm %s BM %d VEC %d TC %d E %d P %d O %d I %d beta %g: %d of %zu wrong",
        LIN ? "linear" : "input_grad", BM, int(VEC), int(TC), E, P, O, I, double(beta), bad, out.size());
}

template <int BM, int BN, int BK, int ES, bool VEC, bool TC, int WARPS_M = 2>
void check_weight_grad(std::mt19937& rng, int E, int P, int M, int N, float beta) {
  const std::vector<int32_t> off = random_offsets(rng, E, P);
  const auto a = random_matrix<ES>(rng, size_t(P) * M);
  const auto b = random_matrix<ES>(rng, size_t(P) * N);
  std::vector<float> out(size_t(E) * M * N), ref;
  for (auto& o : out) o = float(int(rng() % 7) - 3);
  ref = out;
  const float alpha = 2.f;
  for (int e = 0; e < E; ++e)
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) {
        float s = 0.f;
        for (int r = off[size_t(e)]; r < off[size_t(e) + 1]; ++r)
          s += elem_f(a[size_t(r) * M + m]) * elem_f(b[size_t(r) * N + n]);
        float& o = ref[(size_t(e) * M + m) * N + n];
        const bool empty = off[size_t(e)] == off[size_t(e) + 1];
        o = (beta != 0.f ? beta * o : 0.f) + (empty ? 0.f : alpha * s);
      }
  const int64_t tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  GemmParams p{a.data(), b.data(), out.data(), nullptr, off.data(), P, M, N, 0, 0, tiles_m, tiles_n,
               krnl::DType::f32, alpha, beta};
  std::vector<int> writes(out.size(), 0);
  emulate<Mode::weight_grad, BM, BN, BK, ES, VEC, TC, ES == 2 ? krnl::DType::bf16 : krnl::DType::f32, 0, WARPS_M>(
      p, E * tiles_m * tiles_n, out, writes);
  int bad = 0;
  for (size_t i = 0; i < out.size(); ++i)
    if (out[i] != ref[i] || writes[i] != 1) ++bad;
  CHECK(bad == 0, "weight_grad BM %d VEC %d TC %d E %d P %d M %d N %d beta %g: %d of %zu wrong", BM, int(VEC),
        int(TC), E, P, M, N, double(beta), bad, out.size());
}

// moe_quantized_matmul (linear or input_grad) against the reference: W_e (O, I) of BITS-bit codes
// packed here bit by bit into each row's little-endian stream, scales and biases (E, O, I / gs) in
// sdt (f32 or DT), each weight s q + b rounded to a 16-bit DT as the tensor-core kernel rounds
// it. The codes of each expert lie in a buffer of exactly E O words words, so a read past the last
// row's codes is a read past the allocation (tests/test_cuda_host.py builds with AddressSanitizer
// where it can). Q = kMxfp4: 4-bit E2M1 codes (kE2M1 below, not the header's e2m1), positive
// power-of-two scales, no biases (a null pointer: a read of one fails under the sanitizer).
constexpr float kE2M1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.f, -0.5f, -1, -1.5f, -2, -3, -4, -6};

template <Mode MODE, int BM, int BN, int BK, krnl::DType DT, bool VEC, bool TC, int Q>
void check_quantized(std::mt19937& rng, int E, int P, int O, int I, int gs, bool f32_scales, float beta) {
  constexpr int BITS = code_bits<Q>;
  constexpr bool MX = Q == kMxfp4;
  constexpr bool LIN = MODE == Mode::linear;
  constexpr int ES = DT == krnl::DType::f32 ? 4 : 2;
  using El = Elem<ES>;
  const int K = LIN ? I : O, N = LIN ? O : I, G = I / gs, words = I * BITS / 32;
  CHECK(I % gs == 0 && (I * BITS) % 32 == 0, "bad test shape I %d gs %d bits %d", I, gs, BITS);
  const std::vector<int32_t> off = random_offsets(rng, E, P);
  std::vector<uint32_t> codes(size_t(E) * O * I);
  for (auto& c : codes) c = rng() % (1u << BITS);
  std::vector<uint32_t> packed(size_t(E) * O * words, 0u);
  for (size_t row = 0; row < size_t(E) * O; ++row)
    for (int j = 0; j < I; ++j)
      for (int b = 0; b < BITS; ++b)  // bit b of code j is bit j BITS + b of the row's stream
        if (codes[row * I + size_t(j)] >> b & 1u) {
          const int64_t at = int64_t(j) * BITS + b;
          packed[row * words + size_t(at >> 5)] |= 1u << (at & 31);
        }
  const float quarter_scales[] = {0.25f, 0.5f, 1.f, 2.f, -0.25f, -0.5f, -1.f};  // MX: the first 4
  std::vector<float> sf(size_t(E) * O * G), bf(sf.size());
  for (auto& v : sf) v = quarter_scales[rng() % (MX ? 4 : 7)];
  for (auto& v : bf) v = MX ? 0.f : float(int(rng() % 7) - 3);
  // scales and biases as the kernel reads them: f32, or DT's bits (exact for these values)
  std::vector<float> s32 = sf, b32 = bf;
  std::vector<uint16_t> s16(sf.size()), b16(sf.size());
  for (size_t i = 0; i < sf.size(); ++i) s16[i] = from_f<DT == krnl::DType::f16 ? DT : krnl::DType::bf16>(sf[i]),
                                         b16[i] = from_f<DT == krnl::DType::f16 ? DT : krnl::DType::bf16>(bf[i]);
  const bool sc32 = f32_scales || DT == krnl::DType::f32;
  const krnl::DType sdt = sc32 ? krnl::DType::f32 : DT;
  // W[e, o, j] = s q + b, rounded to a 16-bit DT
  std::vector<float> W(codes.size());
  for (int e = 0; e < E; ++e)
    for (int o = 0; o < O; ++o)
      for (int j = 0; j < I; ++j) {
        const size_t row = size_t(e) * O + size_t(o), g = row * G + size_t(j / gs);
        const uint32_t c = codes[row * I + size_t(j)];
        float v = MX ? sf[g] * kE2M1[c] : sf[g] * float(c) + bf[g];
        if constexpr (ES == 2) v = to_f<DT>(from_f<DT>(v));
        W[row * I + size_t(j)] = v;
      }
  std::vector<El> x(size_t(P) * K);
  for (auto& v : x) {
    const float f = float(int(rng() % 9) - 4);
    if constexpr (ES == 2)
      v = from_f<DT>(f);
    else
      v = f;
  }
  std::vector<float> out(size_t(P) * N), ref;
  for (auto& o : out) o = float(int(rng() % 7) - 3);
  ref = out;
  for (int e = 0; e < E; ++e)
    for (int r = off[size_t(e)]; r < off[size_t(e) + 1]; ++r)
      for (int n = 0; n < N; ++n) {
        float acc = 0.f;
        for (int k = 0; k < K; ++k)
          acc += to_f<DT>(x[size_t(r) * K + k]) *
                 (LIN ? W[(size_t(e) * O + n) * I + k] : W[(size_t(e) * O + k) * I + n]);
        float& o = ref[size_t(r) * N + n];
        o = beta != 0.f ? beta * o + acc : acc;
      }
  const int T = (P + BM - 1) / BM + E;
  const std::vector<int4> map = tile_map(off, E, P, BM, T);
  const int64_t tiles_n = (N + BN - 1) / BN;
  GemmParams p{x.data(), nullptr, out.data(), map.data(), off.data(), P, 0, N, K, 0, 0, tiles_n, krnl::DType::f32,
               1.f, beta};
  int gs_log2 = 0;
  while ((1 << gs_log2) < gs) ++gs_log2;
  const void* sp = sc32 ? static_cast<const void*>(s32.data()) : s16.data();
  const void* bp = MX ? nullptr : sc32 ? static_cast<const void*>(b32.data()) : b16.data();
  const QuantParams q{packed.data(), sp, bp, words, G, int64_t(O) * G, int64_t(O) * G, gs_log2, sdt};
  std::vector<int> writes(out.size(), 0);
  emulate<MODE, BM, BN, BK, ES, VEC, TC, DT, Q>(p, T * tiles_n, out, writes, q);
  int bad = 0;
  for (size_t i = 0; i < out.size(); ++i)
    if (out[i] != ref[i] || writes[i] != 1) ++bad;
  CHECK(bad == 0, "moe_quantized_matmul %s BM %d dt %d VEC %d TC %d q %d gs %d E %d P %d O %d I %d scales %s "
        "beta %g: %d of %zu wrong", LIN ? "linear" : "input_grad", BM, int(DT), int(VEC), int(TC), Q, gs, E, P, O,
        I, sc32 ? "f32" : "16-bit", double(beta), bad, out.size());
}

// One configuration of the launches of moe_quantized_matmul (moe_quantized.cu): the tensor-core
// geometry (BN 128, BK 32) with BM 128 or 64 by 16-byte units and BM 64 per element, the CUDA-core
// one (64 x 64 x 16) both ways, for one code width (or kMxfp4, whose groups are 32: GS).
template <int Q>
void check_quantized_widths(std::mt19937& rng) {
  using krnl::DType;
  constexpr int GS = Q == kMxfp4 ? 32 : 16;
  // a last step of 16 (BK 32) for even widths in groups of 16 (odd ones need I % 32 = 0)
  constexpr int I1 = Q % 2 || GS == 32 ? 64 : 48;
  constexpr int I2 = 160;  // two column tiles of 128 (three of 64), the last partial
  for (float beta : {0.f, 0.5f}) {
    // bf16, 16-byte units, BM 64 and 128; scales in bf16 and f32; groups of 16 (two a step of 32)
    check_quantized<Mode::linear, 64, 128, 32, DType::bf16, true, true, Q>(rng, 6, 203, 136, I1, GS, false, beta);
    check_quantized<Mode::input_grad, 64, 128, 32, DType::bf16, true, true, Q>(rng, 5, 150, 40, I2, GS, true, beta);
    check_quantized<Mode::linear, 128, 128, 32, DType::bf16, true, true, Q>(rng, 3, 300, 264, I2, 32, true, beta);
    check_quantized<Mode::input_grad, 128, 128, 32, DType::bf16, true, true, Q>(rng, 2, 260, 72, I2, 32, false, beta);
    // f16, per element (odd O): BM 64
    check_quantized<Mode::linear, 64, 128, 32, DType::f16, false, true, Q>(rng, 4, 97, 37, I1, GS, false, beta);
    check_quantized<Mode::input_grad, 64, 128, 32, DType::f16, false, true, Q>(rng, 4, 97, 37, I2, GS, true, beta);
    // f32 on CUDA cores (steps of 16: odd widths' runs from bit 16), 16-byte units and per element
    check_quantized<Mode::linear, 64, 64, 16, DType::f32, true, false, Q>(rng, 5, 120, 68, I2, GS, true, beta);
    check_quantized<Mode::input_grad, 64, 64, 16, DType::f32, true, false, Q>(rng, 5, 120, 68, I2, 32, true, beta);
    check_quantized<Mode::linear, 64, 64, 16, DType::f32, false, false, Q>(rng, 3, 91, 37, I1, GS, true, beta);
    check_quantized<Mode::input_grad, 64, 64, 16, DType::f32, false, false, Q>(rng, 3, 91, 37, I1, GS, true, beta);
  }
}

// moe_sort's three kernels, warps as 32-lane loops, W warps a block.
void check_sort(std::mt19937& rng, int N, int K, int E, int W) {
  const int64_t P = int64_t(N) * K, RUN = 512, R = (P + RUN - 1) / RUN;
  std::vector<int32_t> ids(static_cast<size_t>(P));
  for (int t = 0; t < N; ++t) {  // K distinct experts a token, skewed
    std::vector<int> pick;
    while (int(pick.size()) < K) {
      const int e = rng() % 2 ? int(rng() % unsigned(std::min(E, 3))) : int(rng() % unsigned(E));
      if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
    }
    for (int k = 0; k < K; ++k) ids[size_t(t) * K + k] = pick[size_t(k)];
  }
  std::vector<int32_t> counts(size_t(std::max<int64_t>(1, R * E)), -9), offsets(size_t(E) + 1, -9);
  std::vector<int32_t> tokens(static_cast<size_t>(P), -9), slot(static_cast<size_t>(P), -9);
  auto expert = [&](int64_t j, int64_t end) { return j < end ? ids[size_t(j)] : -1; };
  auto match = [&](const int (&key)[32], int lane) {
    unsigned m = 0;
    for (int l = 0; l < 32; ++l)
      if (key[l] == key[lane]) m |= 1u << l;
    return m;
  };
  const int64_t blocks = (R + W - 1) / W;
  for (int pass = 0; pass < 2; ++pass) {  // 0: count, 1: place
    for (int64_t blk = 0; blk < blocks; ++blk) {
      std::vector<int32_t> sh(size_t(W) * E);
      for (int i = 0; i < W * E; ++i) {
        const int64_t rr = blk * W + i / E;
        sh[size_t(i)] = pass == 0 ? 0 : (rr < R ? counts[size_t(rr * E + i % E)] : 0);
      }
      for (int w = 0; w < W; ++w) {
        const int64_t r = blk * W + w;
        if (r >= R) continue;
        int32_t* c = sh.data() + size_t(w) * E;
        const int64_t end = std::min(P, (r + 1) * RUN);
        for (int64_t j0 = r * RUN; j0 < end; j0 += 32) {
          int x[32], key[32];
          for (int lane = 0; lane < 32; ++lane) {
            x[lane] = expert(j0 + lane, end);
            key[lane] = x[lane] < 0 ? E + lane : x[lane];
          }
          int32_t add[32] = {};
          for (int lane = 0; lane < 32; ++lane) {
            const unsigned peers = match(key, lane);
            if (x[lane] < 0) continue;
            if (pass == 1) {
              const int32_t s = c[x[lane]] + __builtin_popcount(peers & ((1u << lane) - 1u));
              slot[size_t(j0 + lane)] = s;
              if (s < P) tokens[size_t(s)] = int32_t((j0 + lane) / K);
            }
            if (lane == __builtin_ctz(peers)) add[lane] = __builtin_popcount(peers);
          }
          for (int lane = 0; lane < 32; ++lane)
            if (add[lane]) c[x[lane]] += add[lane];
        }
      }
      if (pass == 0)
        for (int i = 0; i < W * E; ++i) {
          const int64_t rr = blk * W + i / E;
          if (rr < R) counts[size_t(rr * E + i % E)] = sh[size_t(i)];
        }
    }
    if (pass == 0) {  // the scan kernel
      std::vector<int32_t> tot(size_t(E), 0);
      for (int e = 0; e < E; ++e)
        for (int64_t r = 0; r < R; ++r) tot[size_t(e)] += counts[size_t(r * E + e)];
      const int per = (E + 31) / 32;
      int32_t mine[32], inc[32];
      for (int lane = 0; lane < 32; ++lane) {
        const int e0 = std::min(E, lane * per), e1 = std::min(E, e0 + per);
        mine[lane] = 0;
        for (int e = e0; e < e1; ++e) mine[lane] += tot[size_t(e)];
        inc[lane] = mine[lane] + (lane ? inc[lane - 1] : 0);
      }
      for (int lane = 0; lane < 32; ++lane) {
        const int e0 = std::min(E, lane * per), e1 = std::min(E, e0 + per);
        int32_t run = inc[lane] - mine[lane];
        for (int e = e0; e < e1; ++e) {
          const int32_t n = tot[size_t(e)];
          tot[size_t(e)] = run, offsets[size_t(e)] = run;
          run += n;
        }
      }
      offsets[size_t(E)] = inc[31];
      for (int e = 0; e < E; ++e) {
        int32_t run = tot[size_t(e)];
        for (int64_t r = 0; r < R; ++r) {
          const int32_t n = counts[size_t(r * E + e)];
          counts[size_t(r * E + e)] = run;
          run += n;
        }
      }
    }
  }
  // The reference: a stable sort of the pairs by expert.
  std::vector<int32_t> order(static_cast<size_t>(P));
  for (int64_t i = 0; i < P; ++i) order[size_t(i)] = int32_t(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ids[size_t(a)] < ids[size_t(b)]; });
  int bad = 0;
  for (int64_t s = 0; s < P; ++s) {
    bad += tokens[size_t(s)] != order[size_t(s)] / K;
    bad += slot[size_t(order[size_t(s)])] != s;
  }
  std::vector<int32_t> ro(size_t(E) + 1, 0);
  for (int32_t id : ids) ++ro[size_t(id) + 1];
  for (int e = 0; e < E; ++e) ro[size_t(e) + 1] += ro[size_t(e)];
  bad += ro != offsets;
  CHECK(bad == 0, "moe_sort N %d K %d E %d W %d: %d wrong", N, K, E, W, bad);
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  // The launched configurations: tensor-core geometry (BN 128, BK 32, 16-bit) with BM 64 or 128 and
  // 16-byte units (dims multiples of 8), BM 64 per element; the narrow tiles; f32's CUDA-core
  // geometry (64 x 64 x 16) both ways; ragged dims and K not a multiple of BK.
  for (float beta : {0.f, 0.5f}) {
    check_forward<Mode::linear, 64, 128, 32, 2, false, true>(rng, 5, 97, 37, 33, beta);
    check_forward<Mode::input_grad, 64, 128, 32, 2, false, true>(rng, 5, 97, 37, 33, beta);
    check_forward<Mode::linear, 64, 128, 32, 2, true, true>(rng, 6, 203, 136, 72, beta);
    check_forward<Mode::input_grad, 64, 128, 32, 2, true, true>(rng, 6, 203, 136, 72, beta);
    check_forward<Mode::linear, 128, 128, 32, 2, true, true>(rng, 3, 300, 264, 40, beta);
    check_forward<Mode::input_grad, 128, 128, 32, 2, true, true>(rng, 3, 300, 40, 264, beta);
    check_forward<Mode::linear, 64, 128, 32, 2, false, true>(rng, 2, 150, 131, 45, beta);
    check_forward<Mode::input_grad, 64, 128, 32, 2, false, true>(rng, 1, 70, 45, 131, beta);
    check_forward<Mode::linear, 64, 64, 16, 4, true, false>(rng, 7, 150, 68, 36, beta);
    check_forward<Mode::input_grad, 64, 64, 16, 4, true, false>(rng, 7, 150, 68, 36, beta);
    check_forward<Mode::linear, 64, 64, 16, 4, false, false>(rng, 4, 91, 37, 33, beta);
    check_forward<Mode::input_grad, 64, 64, 16, 4, false, false>(rng, 4, 91, 37, 33, beta);
    check_weight_grad<128, 128, 32, 2, true, true>(rng, 5, 180, 136, 264, beta);
    check_weight_grad<64, 128, 32, 2, false, true>(rng, 4, 90, 17, 33, beta);
    check_weight_grad<64, 64, 16, 4, true, false>(rng, 5, 120, 68, 72, beta);
    check_weight_grad<64, 64, 16, 4, false, false>(rng, 4, 90, 17, 33, beta);
    // the narrow tiles of a LoRA's r <= 32 columns or rows: 8 x 1 warps, 4 x 2, 1 x 8
    check_forward<Mode::linear, 128, 32, 32, 2, true, true, 8>(rng, 4, 400, 16, 264, beta);
    check_forward<Mode::input_grad, 128, 32, 32, 2, true, true, 8>(rng, 4, 400, 264, 24, beta);
    check_forward<Mode::linear, 64, 32, 32, 2, true, true, 4>(rng, 6, 203, 32, 72, beta);
    check_forward<Mode::input_grad, 64, 32, 32, 2, true, true, 4>(rng, 6, 203, 72, 8, beta);
    check_weight_grad<128, 32, 32, 2, true, true, 8>(rng, 5, 180, 136, 16, beta);
    check_weight_grad<32, 128, 32, 2, true, true, 1>(rng, 5, 180, 24, 264, beta);
  }
  // A single expert with P = 0 rows (weight_grad: all empty) and an expert count above 32 lanes.
  check_weight_grad<128, 128, 32, 2, true, true>(rng, 3, 0, 16, 24, 0.5f);
  check_forward<Mode::linear, 64, 128, 32, 2, true, true>(rng, 70, 260, 24, 16, 0.5f);
  // moe_quantized_matmul: every code width; groups of 128 (of 64) over whole column tiles and
  // steps; more experts than a warp has lanes.
  check_quantized_widths<2>(rng);
  check_quantized_widths<3>(rng);
  check_quantized_widths<4>(rng);
  check_quantized_widths<5>(rng);
  check_quantized_widths<6>(rng);
  check_quantized_widths<8>(rng);
  check_quantized_widths<kMxfp4>(rng);  // mode mxfp4: s e2m1(q), no biases
  check_quantized<Mode::linear, 64, 128, 32, krnl::DType::bf16, true, true, 4>(rng, 2, 90, 24, 256, 128, false, 0.5f);
  check_quantized<Mode::input_grad, 64, 128, 32, krnl::DType::bf16, true, true, 3>(rng, 2, 90, 24, 256, 128, false,
                                                                                   0.5f);
  check_quantized<Mode::input_grad, 64, 64, 16, krnl::DType::f32, true, false, 5>(rng, 3, 100, 20, 192, 64, true, 0.f);
  check_quantized<Mode::linear, 64, 128, 32, krnl::DType::f16, true, true, 5>(rng, 70, 260, 24, 32, 32, false, 0.5f);
  // moe_sort: one run, many runs and blocks, experts above and below 32 lanes, fewer warps a block.
  check_sort(rng, 1, 1, 1, 8);
  check_sort(rng, 33, 8, 60, 8);
  check_sort(rng, 700, 8, 128, 8);
  check_sort(rng, 3000, 6, 7, 8);
  check_sort(rng, 1500, 4, 700, 3);
  std::printf(failures ? "moe_tiles_check: %d failures\n" : "moe_tiles_check: ok\n", failures);
  return failures ? 1 : 0;
}
