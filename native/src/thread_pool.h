// Fixed-size worker pool (condition-variable driven) and a work-sharing helper where the
// calling thread runs shares itself, so a pool saturated by async pulls cannot deadlock.
#pragma once

#include <condition_variable>
#include <cstddef>
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

// Runs fn(0..shares-1). Up to shares-1 pool workers help; the caller claims shares too and
// returns when every share has finished.
void run_shares(ThreadPool& pool, size_t shares, const std::function<void(size_t)>& fn);

}  // namespace hixl
