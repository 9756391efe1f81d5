// The compiled Metal libraries of a device (docs/architecture.md, 'The Metal backend'), portable so
// that CI tests the scheduling (krnl._core.testing.LibraryCacheProbe runs it with a fake
// compiler): device.mm instantiates it with id<MTLLibrary>.
//
// Compiling every library on first use made the first step wait for each family's compile in
// turn. Here a background thread, started with the device, compiles every library in order; an op
// that needs one takes it when ready, waits while another thread compiles it, and compiles it
// itself when nobody has started it yet (so the first step never waits behind a library it does
// not need). Each library is compiled once. A failure is kept and raised, in one line naming the
// op and the library, by every op that needs that library; the others work.
#pragma once
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace krnl::metal {

template <class Lib>
class LibraryCache {
 public:
  // compile(name) returns the library or throws; it runs on the background thread or on a caller's.
  using Compile = std::function<Lib(const std::string& name)>;

  LibraryCache(const std::vector<std::string>& names, Compile compile) : compile_(std::move(compile)) {
    for (const std::string& n : names) {
      order_.push_back(n);
      entries_[n];
    }
  }
  ~LibraryCache() { stop(); }
  LibraryCache(const LibraryCache&) = delete;
  LibraryCache& operator=(const LibraryCache&) = delete;

  // Starts the background thread (once): it compiles, in order, every library nobody has started.
  void start_background() {
    std::lock_guard<std::mutex> lk(mu_);
    if (background_.joinable() || stop_) return;
    background_ = std::thread([this] { run_background(); });
  }

  // Stops the background thread after the library it is compiling, and joins it: at exit, before
  // the statics the compile function reads are destroyed (device.mm registers this with atexit).
  void stop() {
    std::thread t;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      t = std::move(background_);
    }
    if (t.joinable()) t.join();
  }

  // The library `name` for op `op` (error messages), compiled if need be.
  Lib get(const std::string& name, const std::string& op) {
    std::unique_lock<std::mutex> lk(mu_);
    auto it = entries_.find(name);
    if (it == entries_.end())
      throw std::invalid_argument("[metal] " + op + ": no library '" + name + "' (metal/*.metal)");
    Entry& e = it->second;
    for (;;) {
      if (e.state == State::done) return e.lib;
      if (e.state == State::failed)
        throw std::runtime_error("[metal] " + op + ": library " + name + " (metal/" + name + ".metal) did not compile: " +
                                 e.error);
      if (e.state == State::pending) {
        compile_locked(name, e, lk);
        continue;
      }
      cv_.wait(lk);  // another thread is compiling it
    }
  }

  // Waits for every library (compiling on this thread those nobody has started) and returns each
  // one's compile time in milliseconds; the first failure is thrown, after every library is done.
  std::map<std::string, double> compile_all(const std::string& op) {
    std::map<std::string, double> ms;
    std::exception_ptr first;
    for (const std::string& n : order_) {
      try {
        get(n, op);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& [n, e] : entries_) ms[n] = e.ms;
    return ms;
  }

  // For tests and reports: how many libraries are compiled (or failed), and how many there are.
  std::pair<size_t, size_t> progress() const {
    std::lock_guard<std::mutex> lk(mu_);
    size_t n = 0;
    for (const auto& [name, e] : entries_) n += e.state == State::done || e.state == State::failed;
    return {n, entries_.size()};
  }
  bool compiled_in_background(const std::string& name) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = entries_.find(name);
    return it != entries_.end() && it->second.background;
  }

 private:
  enum class State { pending, compiling, done, failed };
  struct Entry {
    State state = State::pending;
    Lib lib{};
    std::string error;  // one line
    double ms = 0;      // compile time
    bool background = false;
  };

  // Compiles e on this thread without holding the lock (a compile takes long; no Metal call is
  // made under it), then publishes the result to every waiter.
  void compile_locked(const std::string& name, Entry& e, std::unique_lock<std::mutex>& lk) {
    e.state = State::compiling;
    e.background = std::this_thread::get_id() == background_.get_id();
    lk.unlock();
    Lib lib{};
    std::string error;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      lib = compile_(name);
    } catch (const std::exception& x) {
      error = one_line(x.what());
    } catch (...) {
      error = "unknown error";
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    lk.lock();
    e.ms = ms;
    if (error.empty()) {
      e.lib = std::move(lib);
      e.state = State::done;
    } else {
      e.error = error;
      e.state = State::failed;
    }
    cv_.notify_all();
  }

  void run_background() {
    std::unique_lock<std::mutex> lk(mu_);
    for (const std::string& n : order_) {
      if (stop_) return;
      Entry& e = entries_[n];
      if (e.state == State::pending) compile_locked(n, e, lk);
    }
  }

  // A compiler log is many lines: errors here are one.
  static std::string one_line(const std::string& s) {
    std::string r;
    for (char c : s) {
      if (c == '\n' || c == '\r') {
        if (!r.empty() && r.compare(r.size() < 3 ? 0 : r.size() - 3, 3, " | ") != 0) r += " | ";
      } else {
        r += c;
      }
    }
    while (r.size() >= 3 && r.compare(r.size() - 3, 3, " | ") == 0) r.resize(r.size() - 3);
    return r.empty() ? "no error description" : r;
  }

  Compile compile_;
  std::vector<std::string> order_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Entry> entries_;  // node-based: an Entry& stays valid while the lock is dropped
  std::thread background_;
  bool stop_ = false;
};

}  // namespace krnl::metal
