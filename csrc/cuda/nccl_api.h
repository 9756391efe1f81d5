// The few NCCL entry points data-parallel training calls, resolved with dlopen at run time from
// libnccl.so.2 (the nvidia-nccl-cu13 wheel that PyTorch's CUDA wheels install, or a system
// NCCL), so that krnl builds without NCCL's headers and imports where no NCCL exists. The
// types and enum values are NCCL's public C ABI (nccl.h of NCCL 2.x), declared here.
//
// The loader itself needs no CUDA: it is compiled into every build, so that CI tests it (a
// missing library, a bad KRNL_NCCL, a library lacking a symbol or too old) on machines without
// a GPU. The communicator, which needs a CUDA stream, is nccl_comm.h (CUDA builds only).
#pragma once
#include <string>

namespace krnl::nccl {

using Comm = void*;    // ncclComm_t, opaque
using Stream = void*;  // cudaStream_t (a pointer: same ABI)
struct UniqueId {      // ncclUniqueId: NCCL_UNIQUE_ID_BYTES = 128, passed by value
  char internal[128];
};
constexpr int kUniqueIdBytes = 128;

enum Result : int {  // ncclResult_t
  kSuccess = 0,
  kUnhandledCudaError = 1,
  kSystemError = 2,
  kInternalError = 3,
  kInvalidArgument = 4,
  kInvalidUsage = 5,
  kRemoteError = 6,
  kInProgress = 7,
};
enum : int { kSum = 0 };       // ncclRedOp_t ncclSum
enum : int { kFloat32 = 7 };   // ncclDataType_t ncclFloat32

// NCCL_VERSION(2, 9, 0): the first NCCL whose collectives a CUDA graph capture may record.
constexpr int kMinVersion = 20900;

struct Api {
  Result (*get_version)(int*) = nullptr;
  Result (*get_unique_id)(UniqueId*) = nullptr;
  Result (*comm_init_rank)(Comm*, int nranks, UniqueId id, int rank) = nullptr;
  Result (*all_reduce)(const void* send, void* recv, size_t count, int dtype, int op, Comm, Stream) = nullptr;
  Result (*comm_destroy)(Comm) = nullptr;
  Result (*comm_abort)(Comm) = nullptr;
  Result (*comm_get_async_error)(Comm, Result*) = nullptr;
  Result (*group_start)() = nullptr;
  Result (*group_end)() = nullptr;
  const char* (*get_error_string)(Result) = nullptr;
  const char* (*get_last_error)(Comm) = nullptr;  // NCCL >= 2.13; nullptr before
  std::string path;  // what dlopen opened
  int version = 0;   // ncclGetVersion's code
};

// The process's NCCL, opened once: KRNL_NCCL (a path; the Python package sets it to an installed
// nvidia-nccl wheel's library) when set, else libnccl.so.2 on the loader's path. Throws
// std::runtime_error("[nccl] ...") naming what was tried, or the missing symbol, or the version.
const Api& api();
// The same loading of one library path, uncached, for the tests (a missing file, a library
// lacking a symbol, an old version).
Api load(const std::string& path);
// "2.27.3" from ncclGetVersion's code (2.8 and older had another encoding).
std::string version_string(int code);
// "[nccl] <what> failed: <NCCL's name of r> (<the library's last error, where it says one>)".
[[noreturn]] void fail(const Api& a, const char* what, Result r, Comm comm = nullptr);

}  // namespace krnl::nccl
