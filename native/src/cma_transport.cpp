// Same-host transport: one-sided process_vm_readv in 1024-iovec batches.
#include <poll.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "transport.h"

namespace hixl {
namespace {

constexpr size_t kIovMax = 1024;
constexpr uint64_t kMinShareBytes = 1u << 20;  // below this a helper's wake-up costs more

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
    uint64_t total = total_bytes(ops);
    size_t shares = std::max<uint64_t>(1, std::min<uint64_t>(threads_, total / kMinShareBytes));
    if (shares == 1) return read_share(ops, deadline);
    MemoryCharge charge(meter_, static_cast<int64_t>((ops.size() + shares) * sizeof(Op)));
    std::vector<std::vector<Op>> parts = split_ops(ops, shares);
    std::vector<Status> results(parts.size());
    run_shares(pool_, parts.size(), [&](size_t i) {
      results[i] = read_share(parts[i], deadline);
    });
    for (auto& s : results) {
      if (!s.ok()) return s;
    }
    return Status::Ok();
  }

 private:
  static Status busy() { return Status::Error(status::kLinkBusy, "link is being unlinked"); }

  Status read_share(const std::vector<Op>& ops, Deadline deadline) {
    iovec local[kIovMax];
    iovec remote[kIovMax];
    for (size_t base = 0; base < ops.size(); base += kIovMax) {
      if (aborted_.load()) return busy();
      if (Clock::now() > deadline) {
        return Status::Error(status::kTimeout, "cma read from pid " + std::to_string(pid_) +
                                                   " did not finish before the deadline");
      }
      size_t count = std::min(kIovMax, ops.size() - base);
      for (size_t i = 0; i < count; ++i) {
        const Op& op = ops[base + i];
        local[i] = {reinterpret_cast<void*>(op.local), op.len};
        remote[i] = {reinterpret_cast<void*>(op.remote), op.len};
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
        size_t done = static_cast<size_t>(n);
        wire::advance_iov(local, count, first, done);
        first = wire::advance_iov(remote, count, first, done);
      }
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
