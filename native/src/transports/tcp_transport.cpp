// Socket transport: READ and WRITE requests on several data connections. A READ's bytes stream
// from the server's registered memory straight into the destination; a WRITE's bytes go
// straight from ours once the server pinned and checked the ranges they land in.
#include <sys/socket.h>

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <mutex>

#include "transports/transport.h"

namespace hixl {
namespace {

constexpr size_t kOpsPerRequest = 8192;
constexpr uint64_t kMinShareBytes = 256u << 10;
// Four 64 KiB loopback segments per wake-up while a DATA reply streams in: about a sixth less
// client CPU per byte for 16-token blocks in the benchmark.
constexpr int kLowWaterBytes = 256 << 10;

// The op list a READ or WRITE request names: the count, then each op's remote address and
// length. Returns the bytes the ops move.
uint64_t encode_ops(const Op* ops, size_t count, wire::Encoder* enc) {
  enc->u32(static_cast<uint32_t>(count));
  uint64_t total = 0;
  for (size_t i = 0; i < count; ++i) {
    enc->u64(ops[i].remote);
    enc->u64(ops[i].len);
    total += ops[i].len;
  }
  return total;
}

// The ops' local ranges as iovecs, after `first` slots left for the caller to fill.
std::vector<iovec> local_iov(const Op* ops, size_t count, size_t first) {
  std::vector<iovec> iov(first + count);
  for (size_t i = 0; i < count; ++i) {
    iov[first + i] = {reinterpret_cast<void*>(ops[i].local), ops[i].len};
  }
  return iov;
}

class TcpTransport final : public Transport {
 public:
  TcpTransport(std::vector<UniqueFd> conns, ThreadPool& pool, MemoryMeter& meter)
      : conns_(std::move(conns)), pool_(pool), meter_(meter) {
    for (auto& c : conns_) idle_.push_back(c.get());
  }

  const char* name() const override { return "tcp"; }

  void abort() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) return;
    aborted_ = true;
    // shutdown (not close) wakes blocked pollers while the descriptors stay valid.
    for (auto& c : conns_) ::shutdown(c.get(), SHUT_RDWR);
    cv_.notify_all();
  }

  bool usable() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return !aborted_;
  }

  // The server checks the source serial itself, under a pin, so `seen` stays 0.
  Status pull(const std::vector<Op>& ops, const PlanBasis& basis, Deadline deadline,
              PeerView* /*seen*/) override {
    return on_shares(ops, deadline, "pull", [&](int fd, const Op* part, size_t n, bool* in_sync) {
      return read(fd, part, n, basis, deadline, in_sync);
    });
  }

  Status push(const std::vector<Op>& ops, uint64_t dst_serial, uint64_t grant,
              Deadline deadline) override {
    return on_shares(ops, deadline, "push", [&](int fd, const Op* part, size_t n, bool* in_sync) {
      return write(fd, part, n, dst_serial, grant, deadline, in_sync);
    });
  }

 private:
  // A share's requests, kOpsPerRequest ops each: (fd, ops, count, in_sync) -> Status.
  using Request = std::function<Status(int, const Op*, size_t, bool*)>;

  Status on_shares(const std::vector<Op>& ops, Deadline deadline, const char* what,
                   const Request& request) {
    try {
      return run_shares_of(ops, deadline, request);
    } catch (const std::exception& e) {
      abort();  // a share may have stopped mid-stream
      return Status::Error(status::kFailed, std::string("tcp ") + what + " failed: " + e.what());
    }
  }

  Status run_shares_of(const std::vector<Op>& ops, Deadline deadline, const Request& request) {
    uint64_t total = total_bytes(ops);
    size_t shares =
        std::max<uint64_t>(1, std::min<uint64_t>(conns_.size(), total / kMinShareBytes));
    Status result;
    bool in_sync = true;
    if (shares == 1) {
      result = share(ops, deadline, request, &in_sync);
    } else {
      MemoryCharge charge(meter_, static_cast<int64_t>((ops.size() + shares) * sizeof(Op)));
      std::vector<std::vector<Op>> parts = split_ops(ops, shares);
      std::vector<Status> results(parts.size());
      std::vector<char> synced(parts.size(), 1);
      run_shares(pool_, parts.size(), [&](size_t i) {
        bool ok = true;
        results[i] = share(parts[i], deadline, request, &ok);
        synced[i] = ok ? 1 : 0;
      });
      for (size_t i = 0; i < results.size(); ++i) {
        in_sync = in_sync && synced[i];
        // Report the root cause: a TIMEOUT or server error rather than the fallout of abort().
        if (!results[i].ok() && (result.ok() || result.code == status::kLinkBusy)) {
          result = results[i];
        }
      }
    }
    // A half-read stream cannot be resynchronised: close every connection of the link. A
    // refusal the server sent instead of the data leaves the stream in step and the link up.
    if (!in_sync) abort();
    return result;
  }

  int checkout(Deadline deadline, Status* st) {
    std::unique_lock<std::mutex> lock(mu_);
    bool ready = cv_.wait_until(lock, deadline, [this] { return aborted_ || !idle_.empty(); });
    if (aborted_) {
      *st = Status::Error(status::kLinkBusy, "link is closing");
      return -1;
    }
    if (!ready) {
      *st = Status::Error(status::kTimeout, "timed out waiting for a free tcp connection");
      return -1;
    }
    int fd = idle_.back();
    idle_.pop_back();
    return fd;
  }

  void checkin(int fd) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      idle_.push_back(fd);
    }
    cv_.notify_one();
  }

  Status share(const std::vector<Op>& ops, Deadline deadline, const Request& request,
               bool* in_sync) {
    Status st;
    int fd = checkout(deadline, &st);
    if (fd < 0) return st;
    for (size_t base = 0; base < ops.size() && st.ok(); base += kOpsPerRequest) {
      size_t count = std::min(kOpsPerRequest, ops.size() - base);
      st = request(fd, ops.data() + base, count, in_sync);
    }
    checkin(fd);
    return st;
  }

  Status failure(const std::string& why, bool timed_out) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_ && !timed_out) return Status::Error(status::kLinkBusy, "link is closing");
    }
    if (timed_out) {
      return Status::Error(status::kTimeout, "tcp transfer did not finish before the deadline");
    }
    return Status::Error(status::kFailed, "tcp transfer failed: " + why);
  }

  // *in_sync is cleared when the stream may be mid-frame (any failure but a whole refusal).
  Status read(int fd, const Op* ops, size_t count, const PlanBasis& basis, Deadline deadline,
              bool* in_sync) {
    MemoryCharge charge(meter_, static_cast<int64_t>(count * (16 + sizeof(iovec))));
    *in_sync = false;
    wire::Encoder enc;
    enc.u64(basis.source_serial);
    const uint64_t expected = encode_ops(ops, count, &enc);
    wire::IoResult io = wire::send_frame(fd, wire::kRead, enc.bytes(), deadline);
    if (!io.ok()) return failure(io.reason, io.timed_out());
    wire::Header h;
    io = wire::recv_header(fd, &h, deadline);
    if (!io.ok()) return failure(io.reason, io.timed_out());
    if (h.type == wire::kError) {
      std::vector<uint8_t> payload;
      if (h.length > wire::kMaxControlPayload) return failure("oversized error frame", false);
      payload.resize(h.length);
      io = wire::recv_all(fd, payload.data(), payload.size(), deadline);
      if (!io.ok()) return failure(io.reason, io.timed_out());
      *in_sync = true;
      return wire::decode_error(payload, "peer refused the read");
    }
    if (h.type == wire::kStale && h.length == 0) {
      *in_sync = true;
      return Status::Error(plan::kStale, "source cache is no longer registered on the peer");
    }
    if (h.type != wire::kData || h.length != expected) {
      return failure("unexpected reply frame type " + std::to_string(h.type), false);
    }
    std::vector<iovec> iov = local_iov(ops, count, 0);
    io = wire::recvv_bulk(fd, iov.data(), count, kLowWaterBytes, deadline);
    if (!io.ok()) return failure(io.reason, io.timed_out());
    *in_sync = true;
    return Status::Ok();
  }

  // A reply that is a whole frame: an ERROR or STALE refusal, or `expected` with no payload.
  // *in_sync is cleared unless the stream is still in step afterwards.
  Status await_reply(int fd, uint16_t expected, Deadline deadline, bool* in_sync) {
    wire::Header h;
    std::vector<uint8_t> payload;
    wire::IoResult io = wire::recv_frame(fd, &h, &payload, wire::kMaxControlPayload, deadline);
    if (!io.ok()) return failure(io.reason, io.timed_out());
    if (h.type == expected && payload.empty()) {
      *in_sync = true;
      return Status::Ok();
    }
    if (h.type == wire::kError) {
      *in_sync = true;
      return wire::decode_error(payload, "peer refused the write");
    }
    if (h.type == wire::kStale && payload.empty()) {
      *in_sync = true;
      return Status::Error(plan::kStale, "destination cache is no longer registered on the peer");
    }
    return failure("unexpected reply frame type " + std::to_string(h.type), false);
  }

  // WRITE, then (once the server pinned and checked the ranges) one DATA frame straight from
  // our memory, then WRITE_DONE when every byte landed.
  Status write(int fd, const Op* ops, size_t count, uint64_t dst_serial, uint64_t grant,
               Deadline deadline, bool* in_sync) {
    MemoryCharge charge(meter_, static_cast<int64_t>(count * (16 + sizeof(iovec))));
    *in_sync = false;
    wire::Encoder enc;
    enc.u64(dst_serial);
    enc.u64(grant);
    enc.u8(wire::kBytesFollow);
    const uint64_t total = encode_ops(ops, count, &enc);
    wire::IoResult io = wire::send_frame(fd, wire::kWrite, enc.bytes(), deadline);
    if (!io.ok()) return failure(io.reason, io.timed_out());
    Status st = await_reply(fd, wire::kWriteReady, deadline, in_sync);
    if (!st.ok()) return st;
    *in_sync = false;
    uint8_t header[wire::kHeaderBytes];
    wire::encode_header(header, wire::kData, total);
    std::vector<iovec> iov = local_iov(ops, count, 1);
    iov[0] = {header, sizeof(header)};
    io = wire::sendv_all(fd, iov.data(), iov.size(), deadline);
    if (!io.ok()) return failure(io.reason, io.timed_out());
    return await_reply(fd, wire::kWriteDone, deadline, in_sync);
  }

  std::vector<UniqueFd> conns_;
  ThreadPool& pool_;
  MemoryMeter& meter_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> idle_;
  bool aborted_ = false;
};

}  // namespace

std::unique_ptr<Transport> make_tcp_transport(std::vector<UniqueFd> conns, ThreadPool& pool,
                                              MemoryMeter& meter) {
  return std::make_unique<TcpTransport>(std::move(conns), pool, meter);
}

}  // namespace hixl
