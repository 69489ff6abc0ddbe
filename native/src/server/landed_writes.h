// A count of the peers' writes that landed in this engine, and a wait for the next one: a
// process waiting for a pushed word sleeps until a write lands instead of polling its memory.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace hixl {

class LandedWrites {
 public:
  // Called by the server once a write's last byte is in place.
  void note() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      count_++;
    }
    landed_.notify_all();
  }

  uint64_t count() const {
    std::lock_guard<std::mutex> lock(mu_);
    return count_;
  }

  // Returns the count once it differs from `seen`, or after `timeout_ms`.
  uint64_t wait_past(uint64_t seen, int64_t timeout_ms) {
    std::unique_lock<std::mutex> lock(mu_);
    landed_.wait_for(lock, std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 0)),
                     [&] { return count_ != seen; });
    return count_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable landed_;
  uint64_t count_ = 0;
};

}  // namespace hixl
