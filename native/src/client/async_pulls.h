// Handles of asynchronous pulls: work posted to the transfer pool, its result and when it
// ended, kept until a caller waits for it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "hixl/engine.h"
#include "common/thread_pool.h"

namespace hixl {

class AsyncPulls {
 public:
  // Every handle holds its work until waited for: a caller that never waits runs into a
  // clear error at this many, rather than growing the queue and the map without bound.
  static constexpr size_t kMaxOutstanding = 4096;

  // Posts `work` to `pool` under a new handle. kEngineFinalized once the pool stopped.
  Status submit(ThreadPool& pool, std::function<Status()> work, uint64_t* handle);
  // Runs `work` on the calling thread under a new handle, which has ended when this returns.
  Status run_here(const std::function<Status()>& work, uint64_t* handle);
  // The work's result once it ended (kPending after timeout_ms; < 0 waits without bound),
  // with when it ended on the steady clock (CLOCK_MONOTONIC: Python's time.monotonic_ns).
  // A handle answers once: afterwards it is unknown (kParamInvalid).
  Status wait(uint64_t handle, int64_t timeout_ms, int64_t* finished_ns);

 private:
  struct Entry {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Status result;
    int64_t finished_ns = 0;

    void settle(Status s);
  };

  // A new handle for `entry`, unless kMaxOutstanding are already waiting to be waited for.
  Status add(std::shared_ptr<Entry> entry, uint64_t* handle);

  std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<Entry>> handles_;
  uint64_t next_handle_ = 1;
};

}  // namespace hixl
