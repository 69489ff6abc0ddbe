// Same-host transport: one-sided process_vm_readv in 1024-iovec batches, chunked over the
// transfer threads. The serving side does no work, so it cannot check a read against its
// table; instead the peer's unregistration count is read before and after the bytes, and a
// pull counts only if no registration of the plan's copy was gone when it started and its
// source registration outlived it. Writes are the one thing the peer's server does itself:
// it pins the destination, checks every range and copies the bytes in from our memory (over
// its own transfer threads, as a pull does), so no byte lands in memory the peer no longer
// has registered.
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "transports/transport.h"

namespace hixl {
namespace {

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

// One process_vm_readv call's ranges. A piece that continues the previous range on one
// side extends it there: the kernel locks the peer's address space and pins its pages once
// per remote range, so blocks adjacent on the peer cost one range even when they land
// apart here.
struct Batch {
  iovec local[kIovMax];
  iovec remote[kIovMax];
  size_t local_count = 0;
  size_t remote_count = 0;

  bool full() const { return local_count == kIovMax || remote_count == kIovMax; }
  bool empty() const { return local_count == 0; }
  void add(uint64_t to, uint64_t from, uint64_t len) {
    append(local, &local_count, to, len);
    append(remote, &remote_count, from, len);
  }
  void clear() { local_count = remote_count = 0; }

 private:
  static void append(iovec* iov, size_t* count, uint64_t addr, uint64_t len) {
    if (*count > 0) {
      iovec& last = iov[*count - 1];
      if (reinterpret_cast<uint64_t>(last.iov_base) + last.iov_len == addr) {
        last.iov_len += len;
        return;
      }
    }
    iov[(*count)++] = {reinterpret_cast<void*>(addr), len};
  }
};

Status read_pieces(int pid, int pidfd, Batch* b, Deadline deadline) {
  if (Clock::now() > deadline) {
    return Status::Error(status::kTimeout, "cma read from pid " + std::to_string(pid) +
                                               " did not finish before the deadline");
  }
  size_t local_first = 0, remote_first = 0;
  while (remote_first < b->remote_count) {
    ssize_t n = ::process_vm_readv(pid, b->local + local_first, b->local_count - local_first,
                                   b->remote + remote_first, b->remote_count - remote_first, 0);
    if (n < 0 && errno == EINTR) continue;
    int err = errno;
    // Checked after every read: a dead peer's pid may already belong to another process.
    if (!process_alive(pidfd)) {
      return Status::Error(status::kFailed,
                           "peer process " + std::to_string(pid) + " exited during a read");
    }
    if (n <= 0) {
      return Status::Error(status::kFailed, "process_vm_readv from pid " + std::to_string(pid) +
                                                ": " +
                                                (n < 0 ? std::strerror(err) : "no progress"));
    }
    // A partial read (the kernel stops at the first range it cannot read) resumes at the
    // byte where it stopped; the next call reports the error if the range is bad.
    size_t done = static_cast<size_t>(n);
    local_first = wire::advance_iov(b->local, b->local_count, local_first, done);
    remote_first = wire::advance_iov(b->remote, b->remote_count, remote_first, done);
  }
  return Status::Ok();
}

// Reads the op memory in [begin, end) with as few process_vm_readv calls as the iovec limit
// allows; `read` performs one call's batch.
template <class Read>
Status read_range(const std::vector<Op>& ops, OpCursor begin, OpCursor end, Read&& read) {
  Batch batch;
  Status st;
  for_each_piece(ops, begin, end, [&](uint64_t to, uint64_t from, uint64_t len) {
    if (batch.full()) {
      st = read(&batch);
      batch.clear();
      if (!st.ok()) return false;
    }
    batch.add(to, from, len);
    return true;
  });
  if (st.ok() && !batch.empty()) st = read(&batch);
  return st;
}

// Reads every op with `read`, spread over the copiers: the ops are cut into chunks (views
// into `ops`, no copy) and every thread, the caller included, claims the next one until none
// is left, so the threads finish together even when one of them loses its core for a while.
// The first failure skips the chunks nobody started.
template <class Read>
Status copy_in_chunks(const std::vector<Op>& ops, const Copiers& copiers, MemoryMeter& meter,
                      Read&& read) {
  const size_t chunks = chunk_count(total_bytes(ops), copiers.threads);
  if (chunks == 1 || copiers.pool == nullptr) {
    return read_range(ops, {0, 0}, {ops.size(), 0}, read);
  }
  std::vector<OpCursor> cuts = cut_ops(ops, chunks);
  MemoryCharge charge(meter, static_cast<int64_t>(cuts.capacity() * sizeof(OpCursor)));
  std::mutex mu;
  Status first_error;
  std::atomic<bool> failed{false};
  run_shares(
      *copiers.pool, cuts.size() - 1,
      [&](size_t i) {
        if (failed.load()) return;
        Status s = read_range(ops, cuts[i], cuts[i + 1], read);
        if (s.ok()) return;
        failed.store(true);
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.ok()) first_error = s;
      },
      static_cast<size_t>(copiers.threads - 1));
  return first_error;
}

class CmaTransport final : public Transport {
 public:
  CmaTransport(int pid, UniqueFd pidfd, uint64_t unregistrations_addr, ControlChannel& control,
               const Identity& me, ThreadPool& pool, int threads, MemoryMeter& meter)
      : pid_(pid),
        pidfd_(std::move(pidfd)),
        unregistrations_addr_(unregistrations_addr),
        control_(control),
        me_(me),
        pool_(pool),
        threads_(threads),
        meter_(meter) {}

  const char* name() const override { return "cma"; }

  // A write in flight waits on the control connection: shutting it down wakes the wait (the
  // connection is mid-exchange then, and unusable anyway).
  void abort() override {
    aborted_.store(true);
    if (writing_.load()) ::shutdown(control_.fd.get(), SHUT_RDWR);
  }
  bool usable() const override { return !aborted_.load(); }

  Status pull(const std::vector<Op>& ops, const PlanBasis& basis, Deadline deadline,
              PeerView* seen) override {
    uint64_t before = 0, after = 0;
    Status s = read_unregistrations(&before, deadline);
    if (!s.ok()) return s;
    seen->unregistrations = before;
    if (before != basis.unregistrations) {
      return Status::Error(plan::kStale, "the peer unregistered caches");
    }
    Status copied = copy(ops, deadline);
    s = read_unregistrations(&after, deadline);
    if (!s.ok()) return s;
    seen->unregistrations = after;
    if (after == before) return copied;
    // A read that failed while the count moved (EFAULT on memory just freed) is a stale
    // plan, not a broken link; a timeout or an abort stays what it is.
    if (copied.ok()) {
      return Status::Error(plan::kTableMoved, "the peer unregistered caches during the read");
    }
    if (copied.code == status::kFailed) return Status::Error(plan::kStale, copied.message);
    return copied;
  }

  // One WRITE request per kOpsPerWrite ops on the control connection; the peer copies each
  // in from our memory and answers when it landed.
  Status push(const std::vector<Op>& ops, uint64_t dst_serial, uint64_t grant,
              Deadline deadline) override {
    std::lock_guard<std::mutex> lock(control_.mu);
    writing_.store(true);
    struct Written {
      std::atomic<bool>& flag;
      ~Written() { flag.store(false); }
    } written{writing_};
    if (aborted_.load()) return busy();
    for (size_t base = 0; base < ops.size(); base += kOpsPerWrite) {
      Status s = write(ops.data() + base, std::min(kOpsPerWrite, ops.size() - base), dst_serial,
                       grant, deadline);
      if (!s.ok()) return s;
    }
    return Status::Ok();
  }

 private:
  static constexpr size_t kOpsPerWrite = 8192;

  Status write(const Op* ops, size_t count, uint64_t dst_serial, uint64_t grant,
               Deadline deadline) {
    MemoryCharge charge(meter_, static_cast<int64_t>(count * 24 + kProbeBytes + 64));
    wire::Encoder enc;
    enc.u64(dst_serial);
    enc.u64(grant);
    enc.u8(wire::kFromWriter);
    enc.u32(static_cast<uint32_t>(count));
    for (size_t i = 0; i < count; ++i) {
      enc.u64(ops[i].remote);
      enc.u64(ops[i].len);
    }
    for (size_t i = 0; i < count; ++i) enc.u64(ops[i].local);
    enc.i64(me_.pid);
    enc.u64(me_.probe_addr);
    enc.raw(me_.probe.data(), me_.probe.size());
    const int fd = control_.fd.get();
    wire::IoResult io = wire::send_frame(fd, wire::kWrite, enc.bytes(), deadline);
    wire::Header h;
    std::vector<uint8_t> reply;
    if (io.ok()) io = wire::recv_frame(fd, &h, &reply, wire::kMaxControlPayload, deadline);
    if (!io.ok()) {
      // The control connection may be mid-frame: nothing more can go over it.
      abort();
      if (io.timed_out()) {
        return Status::Error(status::kTimeout, "cma write did not finish before the deadline");
      }
      return Status::Error(status::kFailed, "cma write failed: " + io.reason);
    }
    if (h.type == wire::kWriteDone && reply.empty()) return Status::Ok();
    if (h.type == wire::kStale && reply.empty()) {
      return Status::Error(plan::kStale, "destination cache is no longer registered on the peer");
    }
    if (h.type == wire::kError) return wire::decode_error(reply, "peer refused the write");
    abort();
    return Status::Error(status::kFailed,
                         "unexpected reply frame type " + std::to_string(h.type) + " to a write");
  }

  static Status busy() { return Status::Error(status::kLinkBusy, "link is being unlinked"); }

  Status copy(const std::vector<Op>& ops, Deadline deadline) {
    return copy_in_chunks(ops, {&pool_, threads_}, meter_,
                          [&](Batch* b) { return read_batch(b, deadline); });
  }

  Status read_unregistrations(uint64_t* out, Deadline deadline) {
    Batch batch;
    batch.add(reinterpret_cast<uint64_t>(out), unregistrations_addr_, sizeof(*out));
    return read_batch(&batch, deadline);
  }

  Status read_batch(Batch* b, Deadline deadline) {
    if (aborted_.load()) return busy();
    return read_pieces(pid_, pidfd_.get(), b, deadline);
  }

  const int pid_;
  UniqueFd pidfd_;
  const uint64_t unregistrations_addr_;
  ControlChannel& control_;
  const Identity me_;
  ThreadPool& pool_;
  const int threads_;
  MemoryMeter& meter_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> writing_{false};
};

}  // namespace

std::unique_ptr<Transport> make_cma_transport(int pid, UniqueFd pidfd,
                                              uint64_t unregistrations_addr,
                                              ControlChannel& control, const Identity& me,
                                              ThreadPool& pool, int threads, MemoryMeter& meter) {
  return std::make_unique<CmaTransport>(pid, std::move(pidfd), unregistrations_addr, control, me,
                                        pool, threads, meter);
}

Status cma_read(int pid, int pidfd, const std::vector<Op>& ops, Deadline deadline,
                const Copiers& copiers, MemoryMeter& meter) {
  return copy_in_chunks(ops, copiers, meter,
                        [&](Batch* b) { return read_pieces(pid, pidfd, b, deadline); });
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
