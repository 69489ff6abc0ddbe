// Fixed-size worker pool (condition-variable driven) and a work-sharing helper where the
// calling thread runs shares itself, so a pool saturated by async pulls cannot deadlock.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace hixl {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Returns false once shutdown started (the task is not run).
  bool post(std::function<void()> task);
  // Runs every queued task, then joins the workers. Idempotent.
  void shutdown();
  int size() const { return static_cast<int>(workers_.size()); }

 private:
  void worker_loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

// Runs fn(0..shares-1). Up to min(shares-1, max_helpers) pool workers help; every thread
// claims the next unclaimed share until none is left (so a descheduled thread delays only
// the share it holds), the caller included; returns when every share has finished.
void run_shares(ThreadPool& pool, size_t shares, const std::function<void(size_t)>& fn,
                size_t max_helpers = SIZE_MAX);

}  // namespace hixl
