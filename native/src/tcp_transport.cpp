// Socket transport: READ requests on several data connections; the server streams the bytes
// straight from its registered memory and we readv them straight into the destination.
#include <sys/socket.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>

#include "transport.h"

namespace hixl {
namespace {

constexpr size_t kOpsPerRequest = 8192;
constexpr uint64_t kMinShareBytes = 256u << 10;
// Four 64 KiB loopback segments per wake-up while a DATA reply streams in: about a sixth less
// client CPU per byte for 16-token blocks in the benchmark.
constexpr int kLowWaterBytes = 256 << 10;

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
    try {
      return pull_shares(ops, basis, deadline);
    } catch (const std::exception& e) {
      abort();  // a share may have stopped mid-stream
      return Status::Error(status::kFailed, std::string("tcp pull failed: ") + e.what());
    }
  }

 private:
  Status pull_shares(const std::vector<Op>& ops, const PlanBasis& basis, Deadline deadline) {
    uint64_t total = total_bytes(ops);
    size_t shares =
        std::max<uint64_t>(1, std::min<uint64_t>(conns_.size(), total / kMinShareBytes));
    Status result;
    bool in_sync = true;
    if (shares == 1) {
      result = pull_share(ops, basis, deadline, &in_sync);
    } else {
      MemoryCharge charge(meter_, static_cast<int64_t>((ops.size() + shares) * sizeof(Op)));
      std::vector<std::vector<Op>> parts = split_ops(ops, shares);
      std::vector<Status> results(parts.size());
      std::vector<char> synced(parts.size(), 1);
      run_shares(pool_, parts.size(), [&](size_t i) {
        bool ok = true;
        results[i] = pull_share(parts[i], basis, deadline, &ok);
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

  Status pull_share(const std::vector<Op>& ops, const PlanBasis& basis, Deadline deadline,
                    bool* in_sync) {
    Status st;
    int fd = checkout(deadline, &st);
    if (fd < 0) return st;
    for (size_t base = 0; base < ops.size() && st.ok(); base += kOpsPerRequest) {
      size_t count = std::min(kOpsPerRequest, ops.size() - base);
      st = request(fd, ops.data() + base, count, basis, deadline, in_sync);
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
      return Status::Error(status::kTimeout, "tcp pull did not finish before the deadline");
    }
    return Status::Error(status::kFailed, "tcp pull failed: " + why);
  }

  // *in_sync is cleared when the stream may be mid-frame (any failure but a whole refusal).
  Status request(int fd, const Op* ops, size_t count, const PlanBasis& basis, Deadline deadline,
                 bool* in_sync) {
    MemoryCharge charge(meter_, static_cast<int64_t>(count * (16 + sizeof(iovec))));
    *in_sync = false;
    wire::Encoder enc;
    enc.u64(basis.source_serial);
    enc.u32(static_cast<uint32_t>(count));
    uint64_t expected = 0;
    for (size_t i = 0; i < count; ++i) {
      enc.u64(ops[i].remote);
      enc.u64(ops[i].len);
      expected += ops[i].len;
    }
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
    std::vector<iovec> iov(count);
    for (size_t i = 0; i < count; ++i) {
      iov[i] = {reinterpret_cast<void*>(ops[i].local), ops[i].len};
    }
    io = wire::recvv_bulk(fd, iov.data(), count, kLowWaterBytes, deadline);
    if (!io.ok()) return failure(io.reason, io.timed_out());
    *in_sync = true;
    return Status::Ok();
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
