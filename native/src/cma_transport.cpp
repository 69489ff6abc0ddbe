// Same-host transport: one-sided process_vm_readv in 1024-iovec batches, chunked over the
// transfer threads.
#include <poll.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "transport.h"

namespace hixl {
namespace {

constexpr size_t kIovMax = 1024;

int pidfd_open(int pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

// A pidfd becomes readable once its process has exited.
bool process_alive(int pidfd) {
  pollfd p{pidfd, POLLIN, 0};
  int r;
  do {
    r = ::poll(&p, 1, 0);
  } while (r < 0 && errno == EINTR);
  return r == 0;
}

class CmaTransport final : public Transport {
 public:
  CmaTransport(int pid, UniqueFd pidfd, ThreadPool& pool, int threads, MemoryMeter& meter)
      : pid_(pid), pidfd_(std::move(pidfd)), pool_(pool), threads_(threads), meter_(meter) {}

  const char* name() const override { return "cma"; }

  void abort() override { aborted_.store(true); }

  Status pull(const std::vector<Op>& ops, Deadline deadline) override {
    const size_t chunks = chunk_count(total_bytes(ops), threads_);
    if (chunks == 1) return read_range(ops, {0, 0}, {ops.size(), 0}, deadline);
    // Chunks are views into `ops` (no copy); every thread claims the next one until none is
    // left, so the threads finish together even when one of them loses its core for a while.
    std::vector<OpCursor> cuts = cut_ops(ops, chunks);
    MemoryCharge charge(meter_, static_cast<int64_t>(cuts.capacity() * sizeof(OpCursor)));
    std::mutex mu;
    Status first_error;
    std::atomic<bool> failed{false};
    run_shares(
        pool_, cuts.size() - 1,
        [&](size_t i) {
          if (failed.load()) return;  // the pull already failed: skip the remaining chunks
          Status s = read_range(ops, cuts[i], cuts[i + 1], deadline);
          if (s.ok()) return;
          failed.store(true);
          std::lock_guard<std::mutex> lock(mu);
          if (first_error.ok()) first_error = s;
        },
        static_cast<size_t>(threads_ - 1));
    return first_error;
  }

 private:
  static Status busy() { return Status::Error(status::kLinkBusy, "link is being unlinked"); }

  // Reads the op memory in [begin, end) with as few process_vm_readv calls as the iovec
  // limit allows.
  Status read_range(const std::vector<Op>& ops, OpCursor begin, OpCursor end, Deadline deadline) {
    iovec local[kIovMax];
    iovec remote[kIovMax];
    size_t count = 0;
    Status st;
    for_each_piece(ops, begin, end, [&](uint64_t to, uint64_t from, uint64_t len) {
      local[count] = {reinterpret_cast<void*>(to), len};
      remote[count] = {reinterpret_cast<void*>(from), len};
      if (++count < kIovMax) return true;
      st = read_batch(local, remote, count, deadline);
      count = 0;
      return st.ok();
    });
    if (st.ok() && count > 0) st = read_batch(local, remote, count, deadline);
    return st;
  }

  Status read_batch(iovec* local, iovec* remote, size_t count, Deadline deadline) {
    if (aborted_.load()) return busy();
    if (Clock::now() > deadline) {
      return Status::Error(status::kTimeout, "cma read from pid " + std::to_string(pid_) +
                                                 " did not finish before the deadline");
    }
    size_t first = 0;
    while (first < count) {
      ssize_t n = ::process_vm_readv(pid_, local + first, count - first, remote + first,
                                     count - first, 0);
      if (n < 0 && errno == EINTR) continue;
      int err = errno;
      // Checked after every read: a dead peer's pid may already belong to another process.
      if (!process_alive(pidfd_.get())) {
        return Status::Error(status::kFailed,
                             "peer process " + std::to_string(pid_) + " exited during a read");
      }
      if (n <= 0) {
        return Status::Error(status::kFailed, "process_vm_readv from pid " +
                                                  std::to_string(pid_) + ": " +
                                                  (n < 0 ? std::strerror(err) : "no progress"));
      }
      // A partial read (the kernel stops at the first range it cannot read) resumes at the
      // byte where it stopped; the next call reports the error if the range is bad.
      size_t done = static_cast<size_t>(n);
      wire::advance_iov(local, count, first, done);
      first = wire::advance_iov(remote, count, first, done);
    }
    return Status::Ok();
  }

  const int pid_;
  UniqueFd pidfd_;
  ThreadPool& pool_;
  const int threads_;
  MemoryMeter& meter_;
  std::atomic<bool> aborted_{false};
};

}  // namespace

std::unique_ptr<Transport> make_cma_transport(int pid, UniqueFd pidfd, ThreadPool& pool,
                                              int threads, MemoryMeter& meter) {
  return std::make_unique<CmaTransport>(pid, std::move(pidfd), pool, threads, meter);
}

Status cma_probe(int pid, uint64_t addr, const uint8_t* expected, size_t len, UniqueFd* pidfd) {
  UniqueFd fd(pidfd_open(pid));
  if (!fd.valid()) {
    return Status::Error(status::kLinkFailed,
                         "pidfd_open(" + std::to_string(pid) + "): " + std::strerror(errno));
  }
  std::vector<uint8_t> got(len);
  iovec local{got.data(), len};
  iovec remote{reinterpret_cast<void*>(addr), len};
  ssize_t n = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
  if (n < 0) {
    return Status::Error(status::kLinkFailed, "process_vm_readv probe of pid " +
                                                  std::to_string(pid) + ": " +
                                                  std::strerror(errno));
  }
  if (static_cast<size_t>(n) != len || std::memcmp(got.data(), expected, len) != 0) {
    return Status::Error(status::kLinkFailed, "probe of pid " + std::to_string(pid) +
                                                  " read another process's memory");
  }
  if (!process_alive(fd.get())) {
    return Status::Error(status::kLinkFailed,
                         "peer process " + std::to_string(pid) + " exited during the probe");
  }
  *pidfd = std::move(fd);
  return Status::Ok();
}

}  // namespace hixl
