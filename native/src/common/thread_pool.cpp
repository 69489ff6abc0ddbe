#include "common/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>
#include <string>
#include <system_error>

namespace hixl {

ThreadPool::ThreadPool(int threads) {
  workers_.reserve(static_cast<size_t>(std::max(0, threads)));
  try {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  } catch (const std::system_error& e) {
    // A destructor does not run for a half-built object: the started workers would be
    // joinable std::threads destroyed unjoined, which terminates the process.
    const size_t started = workers_.size();
    shutdown();
    throw std::system_error(e.code(), "cannot start transfer thread " +
                                          std::to_string(started + 1) + " of " +
                                          std::to_string(threads) + " (the " +
                                          std::to_string(started) + " started were stopped)");
  }
}

ThreadPool::~ThreadPool() { shutdown(); }

bool ThreadPool::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
  return true;
}

void ThreadPool::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) {
    if (t.joinable()) t.join();
  }
}

void ThreadPool::worker_loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      task();
    } catch (...) {  // e.g. std::bad_alloc: losing one task must not terminate the process
      task_failures_++;
    }
  }
}

namespace {

struct ShareState {
  explicit ShareState(size_t n, const std::function<void(size_t)>& f) : total(n), fn(f) {}
  const size_t total;
  const std::function<void(size_t)>& fn;  // outlives the state's use: see run_shares
  std::atomic<size_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  size_t finished = 0;
  std::exception_ptr first_error;  // guarded by mu

  // Claims and runs shares until none are left. Never throws: a share's exception is kept
  // for the caller and the unclaimed shares are skipped (claimed and counted, not run).
  void drain() {
    for (;;) {
      size_t i = next.fetch_add(1);
      if (i >= total) return;
      std::exception_ptr error;
      try {
        fn(i);
      } catch (...) {
        error = std::current_exception();
      }
      size_t skipped = 0;
      if (error) {
        size_t claimed = next.exchange(total);
        if (claimed < total) skipped = total - claimed;
      }
      std::lock_guard<std::mutex> lock(mu);
      if (error && !first_error) first_error = error;
      finished += 1 + skipped;
      if (finished == total) cv.notify_all();
    }
  }
};

}  // namespace

void run_shares(ThreadPool& pool, size_t shares, const std::function<void(size_t)>& fn,
                size_t max_helpers) {
  if (shares == 0) return;
  auto state = std::make_shared<ShareState>(shares, fn);
  // A helper that starts after all shares were claimed touches only `next`, never fn,
  // so fn may go out of scope once every share finished.
  const size_t helpers = std::min(shares - 1, max_helpers);
  for (size_t i = 0; i < helpers; ++i) {
    // If posting fails (shutdown, or out of memory) the caller simply does more shares; an
    // exception must not leave here while posted helpers may still call fn.
    bool posted = false;
    try {
      posted = pool.post([state] { state->drain(); });
    } catch (...) {
    }
    if (!posted) break;
  }
  state->drain();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->finished == state->total; });
  if (state->first_error) std::rethrow_exception(state->first_error);
}

}  // namespace hixl
