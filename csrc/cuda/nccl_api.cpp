// The NCCL loader (nccl_api.h). Plain C++ and dlopen: compiled into every build.
#include "nccl_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>

namespace krnl::nccl {

std::string version_string(int code) {
  // NCCL_VERSION(X, Y, Z): X*1000 + Y*100 + Z up to 2.8, X*10000 + Y*100 + Z from 2.9 on.
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? code % 10000 / 100 : code % 1000 / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

Api load(const std::string& path) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = dlerror();
    throw std::runtime_error("[nccl] cannot open " + path + ": " + (e ? e : "unknown dlopen error"));
  }
  Api a;
  a.path = path;
  auto sym = [&](const char* name, bool required = true) {
    void* f = dlsym(lib, name);
    if (!f && required) {
      dlclose(lib);
      throw std::runtime_error("[nccl] " + path + " lacks " + name + " (not an NCCL 2 library?)");
    }
    return f;
  };
  a.get_version = reinterpret_cast<decltype(a.get_version)>(sym("ncclGetVersion"));
  a.get_unique_id = reinterpret_cast<decltype(a.get_unique_id)>(sym("ncclGetUniqueId"));
  a.comm_init_rank = reinterpret_cast<decltype(a.comm_init_rank)>(sym("ncclCommInitRank"));
  a.all_reduce = reinterpret_cast<decltype(a.all_reduce)>(sym("ncclAllReduce"));
  a.comm_destroy = reinterpret_cast<decltype(a.comm_destroy)>(sym("ncclCommDestroy"));
  a.comm_abort = reinterpret_cast<decltype(a.comm_abort)>(sym("ncclCommAbort"));
  a.comm_get_async_error = reinterpret_cast<decltype(a.comm_get_async_error)>(sym("ncclCommGetAsyncError"));
  a.group_start = reinterpret_cast<decltype(a.group_start)>(sym("ncclGroupStart"));
  a.group_end = reinterpret_cast<decltype(a.group_end)>(sym("ncclGroupEnd"));
  a.get_error_string = reinterpret_cast<decltype(a.get_error_string)>(sym("ncclGetErrorString"));
  a.get_last_error = reinterpret_cast<decltype(a.get_last_error)>(sym("ncclGetLastError", false));
  if (a.get_version(&a.version) != kSuccess) {
    dlclose(lib);
    throw std::runtime_error("[nccl] ncclGetVersion failed in " + path);
  }
  if (a.version < kMinVersion) {
    dlclose(lib);
    throw std::runtime_error("[nccl] " + path + " is NCCL " + version_string(a.version) +
                             ", older than 2.9 (the first whose collectives a CUDA graph may record)");
  }
  return a;  // the library stays open for the process
}

const Api& api() {
  static std::once_flag once;
  static Api loaded;
  static std::string error;
  std::call_once(once, [] {
    const char* env = std::getenv("KRNL_NCCL");
    const std::string path = env && *env ? env : "libnccl.so.2";
    try {
      loaded = load(path);
    } catch (const std::exception& e) {
      error = e.what();
      if (!(env && *env))  // say how to get one
        error += " (KRNL_NCCL is unset and no nvidia-nccl wheel was found: pip install nvidia-nccl-cu13, "
                 "or set KRNL_NCCL to a libnccl.so.2)";
      else
        error += " (from KRNL_NCCL)";
    }
  });
  if (!error.empty()) throw std::runtime_error(error);
  return loaded;
}

void fail(const Api& a, const char* what, Result r, Comm comm) {
  std::string msg = std::string("[nccl] ") + what + " failed: " + (a.get_error_string ? a.get_error_string(r) : "?");
  if (a.get_last_error) {
    const char* last = a.get_last_error(comm);
    if (last && *last) msg += std::string(" (") + last + ")";
  }
  // One line: NCCL's last error can span several.
  for (char& c : msg)
    if (c == '\n') c = ' ';
  throw std::runtime_error(msg);
}

}  // namespace krnl::nccl
