// Engine counters and the meter for memory the engine itself holds (plans, frames).
#pragma once

#include <atomic>
#include <cstdint>

namespace hixl {

struct EngineStats {
  std::atomic<int64_t> pulls{0}, failures{0}, bytes{0}, ops{0}, runs{0}, timeouts{0};
  std::atomic<int64_t> links{0}, served_bytes{0}, served_requests{0}, rejected_requests{0};
  std::atomic<int64_t> caller_batches{0};  // submitted batches copied on the caller's thread
  std::atomic<int64_t> pushes{0}, pushed_bytes{0};            // this engine's writes to peers
  std::atomic<int64_t> received_writes{0}, received_bytes{0};  // peers' writes to this engine
};

class MemoryMeter {
 public:
  void add(int64_t n) {
    int64_t now = current_.fetch_add(n) + n;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }
  void sub(int64_t n) { current_.fetch_sub(n); }
  int64_t peak() const { return peak_.load(); }

 private:
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};

// Charges `bytes` to the meter for the lifetime of this object.
class MemoryCharge {
 public:
  MemoryCharge(MemoryMeter& meter, int64_t bytes) : meter_(meter), bytes_(bytes) {
    meter_.add(bytes_);
  }
  ~MemoryCharge() { meter_.sub(bytes_); }
  MemoryCharge(const MemoryCharge&) = delete;
  MemoryCharge& operator=(const MemoryCharge&) = delete;

 private:
  MemoryMeter& meter_;
  int64_t bytes_;
};

}  // namespace hixl
