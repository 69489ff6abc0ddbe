// Fixed-size worker pool (condition-variable driven) and a work-sharing helper where the
// calling thread runs shares itself, so a pool saturated by async pulls cannot deadlock.
#pragma once

#include <atomic>
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
  // Throws std::system_error when a thread cannot be started; the workers already started
  // are stopped and joined first.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Returns false once shutdown started (the task is not run).
  bool post(std::function<void()> task);
  // Runs every queued task, then joins the workers. Idempotent.
  void shutdown();
  int size() const { return static_cast<int>(workers_.size()); }
  // Posted tasks that ended with an exception. A worker catches it so the process survives;
  // the task itself must report its result (a task that sets a handle's status must catch).
  int64_t task_failures() const { return task_failures_.load(); }

 private:
  void worker_loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::atomic<int64_t> task_failures_{0};
  std::vector<std::thread> workers_;
};

// Runs fn(0..shares-1). Up to min(shares-1, max_helpers) pool workers help; every thread
// claims the next unclaimed share until none is left (so a descheduled thread delays only
// the share it holds), the caller included; returns when every share has finished.
// A share that throws does not take its thread down: the shares nobody claimed yet are
// skipped, run_shares waits for the ones in flight and then rethrows the first exception in
// the caller, exactly as a sequential loop over the shares would have.
void run_shares(ThreadPool& pool, size_t shares, const std::function<void(size_t)>& fn,
                size_t max_helpers = SIZE_MAX);

}  // namespace hixl
