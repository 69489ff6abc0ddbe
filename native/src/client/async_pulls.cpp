#include "client/async_pulls.h"

#include <chrono>
#include <string>

namespace hixl {
namespace {

int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void AsyncPulls::Entry::settle(Status s) {
  std::lock_guard<std::mutex> lock(mu);
  result = std::move(s);
  finished_ns = steady_now_ns();
  done = true;
  cv.notify_all();
}

Status AsyncPulls::add(std::shared_ptr<Entry> entry, uint64_t* handle) {
  std::lock_guard<std::mutex> lock(mu_);
  if (handles_.size() >= kMaxOutstanding) {
    return Status::Error(status::kFailed, std::to_string(kMaxOutstanding) +
                                              " pulls are already submitted and not yet "
                                              "waited for");
  }
  *handle = next_handle_++;
  handles_[*handle] = std::move(entry);
  return Status::Ok();
}

Status AsyncPulls::submit(ThreadPool& pool, std::function<Status()> work, uint64_t* handle) {
  auto entry = std::make_shared<Entry>();
  Status added = add(entry, handle);
  if (!added.ok()) return added;
  // The engine's pull turns every exception into a status.
  bool posted = pool.post([entry, work = std::move(work)] { entry->settle(work()); });
  if (!posted) {
    std::lock_guard<std::mutex> lock(mu_);
    handles_.erase(*handle);
    return Status::Error(status::kEngineFinalized, "engine is closed");
  }
  return Status::Ok();
}

Status AsyncPulls::run_here(const std::function<Status()>& work, uint64_t* handle) {
  auto entry = std::make_shared<Entry>();
  Status added = add(entry, handle);
  if (!added.ok()) return added;
  entry->settle(work());
  return Status::Ok();
}

Status AsyncPulls::wait(uint64_t handle, int64_t timeout_ms, int64_t* finished_ns) {
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handles_.find(handle);
    if (it == handles_.end()) return Status::Error(status::kParamInvalid, "unknown handle");
    entry = it->second;
  }
  {
    std::unique_lock<std::mutex> lock(entry->mu);
    auto done = [&] { return entry->done; };
    if (timeout_ms < 0) {
      entry->cv.wait(lock, done);
    } else if (!entry->cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), done)) {
      return Status::Error(status::kPending, "pull still running");
    }
  }
  if (finished_ns != nullptr) *finished_ns = entry->finished_ns;
  std::lock_guard<std::mutex> lock(mu_);
  handles_.erase(handle);
  return entry->result;
}

}  // namespace hixl
