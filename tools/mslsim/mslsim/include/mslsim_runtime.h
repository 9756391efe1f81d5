// mslsim_runtime.h -- executes a compute dispatch on the CPU.
//
// * one fiber per GPU thread; the fibers of a threadgroup run on one OS thread, each until it
//   blocks at a barrier / SIMD collective or returns (cooperative, deterministic unless
//   F_RANDOM_ORDER is set, which shuffles the order after every synchronisation point);
// * threadgroup_barrier releases when every live thread of the group waits at the same barrier;
//   SIMD collectives release when every live lane of the SIMD-group waits at the same collective
//   (lanes that returned are inactive, as on the GPU); anything else is reported as divergence;
// * threadgroups are distributed over worker OS threads;
// * out-of-bounds accesses that hit the guard page behind a buffer, fiber stack overflows and
//   other SIGSEGVs inside a kernel are turned into an error message instead of a crash.
#pragma once

#include <csetjmp>
#include <mutex>
#include <csignal>
#include <random>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#if defined(__x86_64__) && !defined(MSLSIM_USE_UCONTEXT)
#define MSLSIM_ASM_SWITCH 1
#endif

namespace mslsim {
namespace rt {

#ifdef MSLSIM_ASM_SWITCH
// Minimal x86-64 SysV fiber switch: saves the callee-saved registers, MXCSR and the x87 control
// word on the current stack, stores the stack pointer to *from and resumes the stack `to`.
// (glibc's swapcontext makes a sigprocmask system call on every switch: ~20x slower.)
__attribute__((naked, noinline)) static void fiber_switch(void** /*from*/, void* /*to*/) {
  __asm__ volatile(
      "pushq %rbp\n\t" "pushq %rbx\n\t" "pushq %r12\n\t" "pushq %r13\n\t" "pushq %r14\n\t" "pushq %r15\n\t"
      "subq $8, %rsp\n\t" "stmxcsr (%rsp)\n\t" "fnstcw 4(%rsp)\n\t"
      "movq %rsp, (%rdi)\n\t" "movq %rsi, %rsp\n\t"
      "ldmxcsr (%rsp)\n\t" "fldcw 4(%rsp)\n\t" "addq $8, %rsp\n\t"
      "popq %r15\n\t" "popq %r14\n\t" "popq %r13\n\t" "popq %r12\n\t" "popq %rbx\n\t" "popq %rbp\n\t"
      "ret\n\t");
}
// Prepare a fresh stack so that the first fiber_switch to it "returns" into entry().
inline void* fiber_init(char* stack_lo, size_t size, void (*entry)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack_lo) + size) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 72);  // 8 slots, ends 8 mod 16 as after a call
  uint32_t mxcsr; uint16_t fpucw;
  __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
  __asm__ volatile("fnstcw %0" : "=m"(fpucw));
  sp[0] = uint64_t(mxcsr) | (uint64_t(fpucw) << 32);
  for (int i = 1; i <= 6; ++i) sp[i] = 0;                // r15 r14 r13 r12 rbx rbp
  sp[7] = reinterpret_cast<uint64_t>(entry);
  return sp;
}
#endif

enum Builtin : int {
  B_thread_position_in_grid = 1, B_thread_position_in_threadgroup, B_threadgroup_position_in_grid,
  B_threadgroups_per_grid, B_threads_per_threadgroup, B_dispatch_threads_per_threadgroup, B_threads_per_grid,
  B_thread_index_in_threadgroup, B_thread_index_in_simdgroup, B_simdgroup_index_in_threadgroup,
  B_simdgroups_per_threadgroup, B_dispatch_simdgroups_per_threadgroup, B_threads_per_simdgroup,
  B_thread_execution_width, B_thread_index_in_quadgroup, B_quadgroup_index_in_threadgroup,
  B_quadgroups_per_threadgroup, B_dispatch_quadgroups_per_threadgroup,
};
enum ParamKind : int { P_BUFFER = 1, P_THREADGROUP, P_BUILTIN, P_ABSENT };
struct ParamDesc { int kind; int index; const char* name; };
struct KernelEntry {
  const char* name;
  void (*invoke)(const ParamDesc*);
  const ParamDesc* params;
  int nparams;
};

enum Flags : uint32_t {
  F_RANDOM_ORDER = 1,         // shuffle fiber order after every sync point (race detector)
  F_NO_POISON = 2,            // do not fill threadgroup memory with 0xFF (NaN) before use
  F_ALLOW_EXIT_BARRIER = 4,   // threads that returned count as arrived at threadgroup_barrier
  F_NO_TG_LIMIT = 8,          // do not enforce the 32 KiB threadgroup memory limit
  F_NO_SITE_CHECK = 16,       // do not require all threads to wait at the same barrier call site
};

struct Launch {
  uint32_t ntg[3];        // threadgroups per grid
  uint32_t tptg[3];       // threads per threadgroup (nominal)
  uint32_t tpgrid[3];     // threads per grid (for dispatchThreads: may not be a multiple)
  void* const* bufs; int nbufs;
  const uint64_t* tgmem; int ntgmem;
  uint32_t flags; uint64_t seed;
  uint64_t tg_limit;
};

enum LaneState : uint8_t { READY, WAIT_TG, WAIT_SIMD, DONE, FAILED };
enum SyncKind : int { K_TG_BARRIER = 1, K_SIMD_BARRIER, K_SIMD_COLLECTIVE, K_SIMD_GATHER };
constexpr int SIMD_WIDTH = 32;
constexpr int SLOT_BYTES = 64;

struct Group;
struct Worker;

struct Lane {
#ifdef MSLSIM_ASM_SWITCH
  void* sp;
#else
  ucontext_t uc;
#endif
  Group* g;
  uint32_t index, simd_lane, simd_group;
  uint32_t tid[3];
  LaneState state;
  int wait_kind; const char* wait_what; const char* wait_file; int wait_line;
  uint32_t simd_seq;
};

struct SimdState {
  alignas(64) unsigned char slot[2][SIMD_WIDTH][SLOT_BYTES];
  uint32_t first, nlanes;
  uint32_t active;        // bit mask of lanes that took part in the last released collective
};

struct Group {
  Worker* w; const Launch* L; const KernelEntry* k;
  uint32_t pos[3], size[3], nthreads, nsimd;
  Lane* lanes; SimdState* simd;
  char* arena; size_t arena_cap, arena_used;
  struct Var { int key; void* p; } vars[64]; int nvars;
  void* tgbuf[32];
};

struct Worker {
#ifdef MSLSIM_ASM_SWITCH
  void* sched_sp = nullptr;
#else
  ucontext_t sched;
  ucontext_t tmpl;
#endif
  char* stacks = nullptr; size_t stack_bytes = 0, stack_stride = 0, stack_map = 0; uint32_t nstacks = 0;
  std::vector<Lane> lanes; std::vector<SimdState> simd; std::vector<uint32_t> order;
  std::vector<char> arena;
  Group group;
  sigjmp_buf jb; volatile bool in_group = false;
  std::string err;
  std::mt19937_64 rng;
  char* altstack = nullptr;
};

inline thread_local Lane* cur_lane = nullptr;
inline thread_local Worker* cur_worker = nullptr;

inline Lane& lane() { return *cur_lane; }

// fiber -> scheduler, scheduler -> fiber
inline void to_scheduler(Lane* L) {
#ifdef MSLSIM_ASM_SWITCH
  fiber_switch(&L->sp, L->g->w->sched_sp);
#else
  swapcontext(&L->uc, &L->g->w->sched);
#endif
}
inline void to_lane(Worker& w, Lane* L) {
#ifdef MSLSIM_ASM_SWITCH
  fiber_switch(&w.sched_sp, L->sp);
#else
  swapcontext(&w.sched, &L->uc);
#endif
}

// error raised from inside a fiber: record and return to the scheduler for good
[[noreturn]] inline void fail(const std::string& msg) {
  Lane* L = cur_lane;
  Worker* w = L->g->w;
  if (w->err.empty()) w->err = msg;
  L->state = FAILED;
  to_scheduler(L);
  __builtin_unreachable();
}

inline void block(Lane* L, LaneState st, int kind, const char* what, const char* file, int line) {
  L->state = st; L->wait_kind = kind; L->wait_what = what; L->wait_file = file; L->wait_line = line;
  to_scheduler(L);
}

// ---- builtins --------------------------------------------------------------------------------
inline void builtin_value(const Lane& l, int kind, uint32_t out[3]) {
  const Group& g = *l.g; const Launch& L = *g.L;
  out[0] = out[1] = out[2] = 0;
  switch (kind) {
    case B_thread_position_in_grid: for (int d = 0; d < 3; ++d) out[d] = g.pos[d] * L.tptg[d] + l.tid[d]; break;
    case B_thread_position_in_threadgroup: for (int d = 0; d < 3; ++d) out[d] = l.tid[d]; break;
    case B_threadgroup_position_in_grid: for (int d = 0; d < 3; ++d) out[d] = g.pos[d]; break;
    case B_threadgroups_per_grid: for (int d = 0; d < 3; ++d) out[d] = L.ntg[d]; break;
    case B_threads_per_threadgroup: for (int d = 0; d < 3; ++d) out[d] = g.size[d]; break;
    case B_dispatch_threads_per_threadgroup: for (int d = 0; d < 3; ++d) out[d] = L.tptg[d]; break;
    case B_threads_per_grid: for (int d = 0; d < 3; ++d) out[d] = L.tpgrid[d]; break;
    case B_thread_index_in_threadgroup: out[0] = l.index; break;
    case B_thread_index_in_simdgroup: out[0] = l.simd_lane; break;
    case B_simdgroup_index_in_threadgroup: out[0] = l.simd_group; break;
    case B_simdgroups_per_threadgroup: out[0] = g.nsimd; break;
    case B_dispatch_simdgroups_per_threadgroup:
      out[0] = (L.tptg[0] * L.tptg[1] * L.tptg[2] + SIMD_WIDTH - 1) / SIMD_WIDTH; break;
    case B_threads_per_simdgroup: case B_thread_execution_width: out[0] = SIMD_WIDTH; break;
    case B_thread_index_in_quadgroup: out[0] = l.index % 4; break;
    case B_quadgroup_index_in_threadgroup: out[0] = l.index / 4; break;
    case B_quadgroups_per_threadgroup: out[0] = (g.nthreads + 3) / 4; break;
    case B_dispatch_quadgroups_per_threadgroup: out[0] = (L.tptg[0] * L.tptg[1] * L.tptg[2] + 3) / 4; break;
    default: break;
  }
}

template <class A> inline A bind_arg(const ParamDesc& d) {
  Lane& l = lane();
  if constexpr (mslsim::is_scalar_v<A> || vtraits<A>::n > 0) {
    if (d.kind == P_BUILTIN) {
      uint32_t v[3];
      builtin_value(l, d.index, v);
      if constexpr (mslsim::is_scalar_v<A>) return A(v[0]);
      else if constexpr (vtraits<A>::n == 2) return A(v[0], v[1]);
      else return A(v[0], v[1], v[2]);
    }
  }
  alignas(64) static char zeros[256] = {};
  void* p = zeros;
  if (d.kind == P_BUFFER) p = l.g->L->bufs[d.index];
  else if (d.kind == P_THREADGROUP) p = l.g->tgbuf[d.index];
  if constexpr (std::is_pointer_v<A>) return d.kind == P_ABSENT ? nullptr : reinterpret_cast<A>(p);
  else if constexpr (std::is_reference_v<A>) return *reinterpret_cast<std::remove_reference_t<A>*>(p);
  else { A a; std::memcpy((void*)&a, p, sizeof(A)); return a; }
}

template <auto F> struct Invoker;
template <class... A, void (*F)(A...)> struct Invoker<F> {
  static constexpr int arity = sizeof...(A);
  static void run(const ParamDesc* d) { call(d, std::index_sequence_for<A...>{}); }
  template <size_t... I> static void call(const ParamDesc* d, std::index_sequence<I...>) { F(bind_arg<A>(d[I])...); }
};

// ---- threadgroup memory ------------------------------------------------------------------------
inline void* tg_alloc(Group& g, size_t bytes, size_t align) {
  size_t off = (g.arena_used + align - 1) & ~(align - 1);
  if (off + bytes > g.arena_cap) return nullptr;
  g.arena_used = off + bytes;
  void* p = g.arena + off;
  if (!(g.L->flags & F_NO_POISON)) std::memset(p, 0xFF, bytes);
  return p;
}

// `threadgroup T name[N];` in a kernel is rewritten to `auto& name = ::mslsim::rt::tg_var<T[N]>(KEY);`
// All threads of the group get the same storage (allocated by whichever thread gets there first).
template <class T> inline T& tg_var(int key) {
  Group& g = *lane().g;
  for (int i = 0; i < g.nvars; ++i) if (g.vars[i].key == key) return *static_cast<T*>(g.vars[i].p);
  if (g.nvars == 64) fail("too many threadgroup variables");
  void* p = tg_alloc(g, sizeof(T), alignof(T) < 16 ? 16 : alignof(T));
  if (!p) {
    fail("threadgroup memory exceeds the limit of " + std::to_string(g.L->tg_limit) + " bytes (static " +
         std::to_string(sizeof(T)) + " bytes requested, " + std::to_string(g.arena_used) + " in use)");
  }
  g.vars[g.nvars++] = {key, p};
  return *static_cast<T*>(p);
}

// ---- scheduler -------------------------------------------------------------------------------
inline void lane_entry() {
  Lane* L = cur_lane;
  L->g->k->invoke(L->g->k->params);
  L = cur_lane;
  L->state = DONE;
  to_scheduler(L);
}

inline std::string site(const Lane& l) {
  std::string s = l.wait_what ? l.wait_what : "?";
  if (l.wait_file) s += std::string(" at ") + l.wait_file + ":" + std::to_string(l.wait_line);
  return s;
}
inline bool same_site(const Lane& a, const Lane& b) {
  return a.wait_kind == b.wait_kind && a.wait_line == b.wait_line &&
         (a.wait_file == b.wait_file || (a.wait_file && b.wait_file && !strcmp(a.wait_file, b.wait_file)));
}

inline std::string group_state(const Group& g) {
  std::string s;
  for (uint32_t i = 0; i < g.nthreads;) {
    const Lane& a = g.lanes[i];
    uint32_t j = i + 1;
    while (j < g.nthreads && g.lanes[j].state == a.state && (a.state == DONE || same_site(g.lanes[j], a))) ++j;
    s += "\n    threads " + std::to_string(i) + ".." + std::to_string(j - 1) + ": ";
    s += a.state == DONE ? std::string("returned") : std::string("waiting in ") + site(a);
    i = j;
  }
  return s;
}

// Returns false when nothing could be released (deadlock / divergence): message in err.
inline bool release(Group& g, std::string& err) {
  bool released = false;
  const uint32_t flags = g.L->flags;
  for (uint32_t s = 0; s < g.nsimd; ++s) {
    SimdState& ss = g.simd[s];
    Lane* first = nullptr; bool all = true; uint32_t mask = 0;
    for (uint32_t i = 0; i < ss.nlanes; ++i) {
      Lane& l = g.lanes[ss.first + i];
      if (l.state == DONE) continue;
      if (l.state != WAIT_SIMD) { all = false; break; }
      if (!first) first = &l;
      else if (!same_site(l, *first)) {
        err = "divergent SIMD-group synchronisation in simdgroup " + std::to_string(s) + ": lane " +
              std::to_string(first->simd_lane) + " waits in " + site(*first) + ", lane " + std::to_string(l.simd_lane) +
              " waits in " + site(l);
        return false;
      }
      mask |= 1u << i;
    }
    if (all && first) {
      ss.active = mask;
      for (uint32_t i = 0; i < ss.nlanes; ++i) if (mask & (1u << i)) g.lanes[ss.first + i].state = READY;
      released = true;
    }
  }
  if (released) return true;
  Lane* first = nullptr; bool all = true; uint32_t ndone = 0;
  for (uint32_t i = 0; i < g.nthreads; ++i) {
    Lane& l = g.lanes[i];
    if (l.state == DONE) { ++ndone; continue; }
    if (l.state != WAIT_TG) { all = false; break; }
    if (!first) first = &l;
    else if (!(flags & F_NO_SITE_CHECK) && !same_site(l, *first)) { all = false; break; }
  }
  if (all && first) {
    if (ndone && !(flags & F_ALLOW_EXIT_BARRIER)) {
      err = "threadgroup_barrier reached by only " + std::to_string(g.nthreads - ndone) + " of " +
            std::to_string(g.nthreads) + " threads (the others returned): undefined behaviour on the GPU";
      err += group_state(g);
      return false;
    }
    for (uint32_t i = 0; i < g.nthreads; ++i) if (g.lanes[i].state == WAIT_TG) g.lanes[i].state = READY;
    return true;
  }
  err = "deadlock / divergent barriers in threadgroup:" + group_state(g);
  return false;
}

inline bool run_group(Worker& w, Group& g) {
  const uint32_t n = g.nthreads;
  for (uint32_t i = 0; i < n; ++i) {
    Lane& l = g.lanes[i];
    char* stack_lo = w.stacks + size_t(i) * w.stack_stride + size_t(getpagesize());
#ifdef MSLSIM_ASM_SWITCH
    l.sp = fiber_init(stack_lo, w.stack_bytes, lane_entry);
#else
    l.uc = w.tmpl;
    l.uc.uc_stack.ss_sp = stack_lo;
    l.uc.uc_stack.ss_size = w.stack_bytes;
    l.uc.uc_link = nullptr;
    makecontext(&l.uc, lane_entry, 0);
#endif
    l.state = READY; l.simd_seq = 0; l.wait_file = nullptr; l.wait_what = nullptr;
  }
  if (w.order.size() != n) { w.order.resize(n); for (uint32_t i = 0; i < n; ++i) w.order[i] = i; }
  for (;;) {
    if (g.L->flags & F_RANDOM_ORDER) std::shuffle(w.order.begin(), w.order.end(), w.rng);
    for (uint32_t k = 0; k < n; ++k) {
      Lane& l = g.lanes[w.order[k]];
      if (l.state != READY) continue;
      cur_lane = &l;
      to_lane(w, &l);
      if (l.state == FAILED) return false;
    }
    bool done = true;
    for (uint32_t i = 0; i < n; ++i) if (g.lanes[i].state != DONE) { done = false; break; }
    if (done) return true;
    std::string err;
    if (!release(g, err)) { w.err = err; return false; }
  }
}

// ---- guard pages & SIGSEGV ---------------------------------------------------------------------
struct GuardRegion { char* lo; char* hi; int buffer; uint64_t size; char* data; };
inline std::vector<GuardRegion>& guard_regions() { static std::vector<GuardRegion> r; return r; }

inline void segv_handler(int sig, siginfo_t* si, void*) {
  Worker* w = cur_worker;
  if (!w || !w->in_group) { signal(sig, SIG_DFL); return; }  // not ours: re-raise with default action
  char* a = static_cast<char*>(si->si_addr);
  char msg[512];
  snprintf(msg, sizeof msg, "%s at address %p", sig == SIGSEGV ? "SIGSEGV" : "SIGBUS", (void*)a);
  for (const GuardRegion& r : guard_regions())
    if (a >= r.lo && a < r.hi)
      snprintf(msg, sizeof msg, "out-of-bounds access to buffer(%d): byte offset %lld, buffer size %llu", r.buffer,
               (long long)(a - r.data), (unsigned long long)r.size);
  if (w->stacks && a >= w->stacks && a < w->stacks + w->stack_map) {
    size_t off = size_t(a - w->stacks) % w->stack_stride;
    if (off < size_t(getpagesize())) snprintf(msg, sizeof msg, "stack overflow in a GPU thread (raise MSLSIM_STACK_KB)");
  }
  Lane* l = cur_lane;
  if (l && w->err.empty()) {
    w->err = std::string(msg) + " in thread " + std::to_string(l->index) + " of threadgroup (" +
             std::to_string(l->g->pos[0]) + "," + std::to_string(l->g->pos[1]) + "," + std::to_string(l->g->pos[2]) + ")";
  }
  siglongjmp(w->jb, 1);
}

// ---- dispatch ----------------------------------------------------------------------------------
struct DispatchState {
  const KernelEntry* k; const Launch* L;
  std::atomic<uint64_t> next{0}; uint64_t total;
  std::atomic<bool> failed{false};
  std::mutex mu; std::string err;
};

inline void worker_main(DispatchState& D, uint64_t stack_kb) {
  Worker w;
  const Launch& L = *D.L;
  const uint32_t tpt = L.tptg[0] * L.tptg[1] * L.tptg[2];
  const size_t page = size_t(getpagesize());
  w.stack_bytes = ((stack_kb * 1024) + page - 1) & ~(page - 1);
  w.stack_stride = w.stack_bytes + page;
  w.stack_map = w.stack_stride * tpt;
  w.stacks = static_cast<char*>(mmap(nullptr, w.stack_map, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  if (w.stacks == MAP_FAILED) { std::lock_guard<std::mutex> g(D.mu); D.err = "cannot map fiber stacks"; D.failed = true; return; }
  for (uint32_t i = 0; i < tpt; ++i) mprotect(w.stacks + size_t(i) * w.stack_stride, page, PROT_NONE);
  w.lanes.resize(tpt);
  w.simd.resize((tpt + SIMD_WIDTH - 1) / SIMD_WIDTH);
  const uint64_t limit = (L.flags & F_NO_TG_LIMIT) ? (64u << 20) : L.tg_limit;
  w.arena.resize(limit + 64);
  w.rng.seed(L.seed * 0x9E3779B97F4A7C15ull + 12345);
#ifndef MSLSIM_ASM_SWITCH
  getcontext(&w.tmpl);
#endif
  // alternate signal stack, so that a fiber stack overflow can still be reported
  stack_t ss{}; stack_t old_ss{};
  w.altstack = static_cast<char*>(malloc(1 << 16));
  ss.ss_sp = w.altstack; ss.ss_size = 1 << 16; ss.ss_flags = 0;
  sigaltstack(&ss, &old_ss);
  cur_worker = &w;

  Group& g = w.group;
  g.w = &w; g.L = &L; g.k = D.k; g.lanes = w.lanes.data(); g.simd = w.simd.data();
  g.arena = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(w.arena.data()) + 63) & ~uintptr_t(63));
  g.arena_cap = limit;
  if (sigsetjmp(w.jb, 1) == 0) {
    for (;;) {
      if (D.failed.load(std::memory_order_relaxed)) break;
      uint64_t id = D.next.fetch_add(1);
      if (id >= D.total) break;
      g.pos[0] = uint32_t(id % L.ntg[0]);
      g.pos[1] = uint32_t((id / L.ntg[0]) % L.ntg[1]);
      g.pos[2] = uint32_t(id / (uint64_t(L.ntg[0]) * L.ntg[1]));
      for (int d = 0; d < 3; ++d) g.size[d] = std::min(L.tptg[d], L.tpgrid[d] - g.pos[d] * L.tptg[d]);
      g.nthreads = g.size[0] * g.size[1] * g.size[2];
      g.nsimd = (g.nthreads + SIMD_WIDTH - 1) / SIMD_WIDTH;
      for (uint32_t i = 0; i < g.nthreads; ++i) {
        Lane& l = g.lanes[i];
        l.g = &g; l.index = i; l.simd_lane = i % SIMD_WIDTH; l.simd_group = i / SIMD_WIDTH;
        l.tid[0] = i % g.size[0]; l.tid[1] = (i / g.size[0]) % g.size[1]; l.tid[2] = i / (g.size[0] * g.size[1]);
      }
      for (uint32_t s = 0; s < g.nsimd; ++s) {
        g.simd[s].first = s * SIMD_WIDTH;
        g.simd[s].nlanes = std::min<uint32_t>(SIMD_WIDTH, g.nthreads - s * SIMD_WIDTH);
        g.simd[s].active = 0;
      }
      g.arena_used = 0; g.nvars = 0;
      bool ok = true;
      for (int i = 0; i < L.ntgmem && i < 32; ++i) {
        g.tgbuf[i] = L.tgmem[i] ? tg_alloc(g, L.tgmem[i], 16) : nullptr;
        if (L.tgmem[i] && !g.tgbuf[i]) {
          w.err = "threadgroup memory lengths exceed the limit of " + std::to_string(limit) + " bytes";
          ok = false;
        }
      }
      w.in_group = true;
      if (ok) ok = run_group(w, g);
      w.in_group = false;
      if (!ok) {
        std::lock_guard<std::mutex> lk(D.mu);
        if (!D.failed) {
          D.err = w.err + "\n  (threadgroup " + std::to_string(g.pos[0]) + "," + std::to_string(g.pos[1]) + "," +
                  std::to_string(g.pos[2]) + ")";
          D.failed = true;
        }
        break;
      }
    }
  } else {  // came back from the SIGSEGV handler
    w.in_group = false;
    std::lock_guard<std::mutex> lk(D.mu);
    if (!D.failed) { D.err = w.err; D.failed = true; }
  }
  cur_worker = nullptr; cur_lane = nullptr;
  sigaltstack(&old_ss, nullptr);
  free(w.altstack);
  munmap(w.stacks, w.stack_map);
}

inline int dispatch(const KernelEntry* k, const Launch& L, int nworkers, char* err, int errlen) {
  auto set_err = [&](const std::string& s) { if (err && errlen > 0) snprintf(err, size_t(errlen), "%s", s.c_str()); };
  const uint64_t tpt = uint64_t(L.tptg[0]) * L.tptg[1] * L.tptg[2];
  if (tpt == 0 || L.ntg[0] == 0 || L.ntg[1] == 0 || L.ntg[2] == 0) { set_err("empty dispatch"); return 1; }
  if (tpt > 1024) { set_err("threads per threadgroup " + std::to_string(tpt) + " > 1024"); return 1; }
  for (int i = 0; i < k->nparams; ++i) {
    const ParamDesc& d = k->params[i];
    if (d.kind == P_BUFFER && (d.index >= L.nbufs || !L.bufs[d.index])) {
      set_err(std::string("kernel ") + k->name + ": parameter '" + d.name + "' needs buffer(" + std::to_string(d.index) + "), which is not bound");
      return 1;
    }
    if (d.kind == P_THREADGROUP && (d.index >= L.ntgmem || d.index >= 32 || !L.tgmem[d.index])) {
      set_err(std::string("kernel ") + k->name + ": parameter '" + d.name + "' needs threadgroup(" + std::to_string(d.index) + ") memory, whose length is not set");
      return 1;
    }
  }
  DispatchState D; D.k = k; D.L = &L;
  D.total = uint64_t(L.ntg[0]) * L.ntg[1] * L.ntg[2];
  uint64_t stack_kb = 256;
  if (const char* s = getenv("MSLSIM_STACK_KB"); s && *s) {
    stack_kb = strtoull(s, nullptr, 10);
    if (stack_kb < 16) { set_err(std::string("MSLSIM_STACK_KB=") + s + ": need a number of KiB >= 16"); return 1; }
  }
  if (nworkers <= 0) nworkers = int(std::max(1u, std::thread::hardware_concurrency()));
  if (uint64_t(nworkers) > D.total) nworkers = int(D.total);
  struct sigaction sa{}, old_segv{}, old_bus{};
  sa.sa_sigaction = segv_handler; sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  std::vector<std::thread> th;
  for (int i = 1; i < nworkers; ++i) th.emplace_back(worker_main, std::ref(D), stack_kb);
  worker_main(D, stack_kb);
  for (auto& t : th) t.join();
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  if (D.failed) { set_err(std::string("kernel ") + k->name + ": " + D.err); return 2; }
  return 0;
}

// ---- guarded buffers: data placed right before a PROT_NONE page ---------------------------------
inline void* guarded_alloc(uint64_t size, int buffer_index) {
  const size_t page = size_t(getpagesize());
  size_t data = (size + 15) & ~size_t(15);
  size_t body = (data + page - 1) & ~(page - 1);
  char* m = static_cast<char*>(mmap(nullptr, body + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (m == MAP_FAILED) return nullptr;
  mprotect(m + body, page, PROT_NONE);
  char* p = m + body - data;
  guard_regions().push_back({m + body, m + body + page, buffer_index, size, p});
  return p;
}
inline void guarded_free(void* p) {
  auto& r = guard_regions();
  for (size_t i = 0; i < r.size(); ++i)
    if (r[i].data == p) {
      const size_t page = size_t(getpagesize());
      char* guard = r[i].lo;
      size_t data = (r[i].size + 15) & ~size_t(15);
      size_t body = (data + page - 1) & ~(page - 1);
      munmap(guard - body, body + page);
      r.erase(r.begin() + long(i));
      return;
    }
}

}  // namespace rt
}  // namespace mslsim

// The generated translation unit ends with MSLSIM_REGISTRY(table): the C ABI used by mslsim.
#define MSLSIM_REGISTRY(table)                                                                                   \
  extern "C" int mslsim_kernel_count() { return int(sizeof(table) / sizeof(table[0])); }                        \
  extern "C" const char* mslsim_kernel_name(int i) { return table[i].name; }                                    \
  extern "C" void* mslsim_guarded_alloc(uint64_t size, int index) { return mslsim::rt::guarded_alloc(size, index); } \
  extern "C" void mslsim_guarded_free(void* p) { mslsim::rt::guarded_free(p); }                                    \
  extern "C" int mslsim_dispatch(const char* name, const uint32_t* ntg, const uint32_t* tptg, const uint32_t* tpgrid, \
                                 void* const* bufs, int nbufs, const uint64_t* tgmem, int ntgmem,                   \
                                 uint32_t flags, uint64_t seed, uint64_t tg_limit, int nworkers,        \
                                 char* err, int errlen) {                                                       \
    for (const auto& k : table)                                                                                  \
      if (!strcmp(k.name, name)) {                                                                               \
        mslsim::rt::Launch L;                                                                                       \
        for (int d = 0; d < 3; ++d) { L.ntg[d] = ntg[d]; L.tptg[d] = tptg[d]; L.tpgrid[d] = tpgrid ? tpgrid[d] : ntg[d] * tptg[d]; } \
        L.bufs = bufs; L.nbufs = nbufs; L.tgmem = tgmem; L.ntgmem = ntgmem;             \
        L.flags = flags; L.seed = seed; L.tg_limit = tg_limit ? tg_limit : 32768;                                \
        return mslsim::rt::dispatch(&k, L, nworkers, err, errlen);                                                  \
      }                                                                                                          \
    if (err && errlen > 0) snprintf(err, size_t(errlen), "no kernel named '%s' in this library", name);          \
    return 1;                                                                                                    \
  }
