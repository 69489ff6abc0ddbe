#include "server/serve_loop.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <system_error>

namespace hixl {
namespace {

constexpr int kSweepMs = 200;
constexpr int kMaxEvents = 256;
constexpr uint64_t kHandshakeFrameBytes = 1024;

void signal_eventfd(int fd) {
  uint64_t one = 1;
  ssize_t ignored = ::write(fd, &one, sizeof(one));
  (void)ignored;
}

bool past(Deadline deadline) { return Clock::now() >= deadline; }

}  // namespace

// A connection: its phase, the frame being read, and what is waiting to be sent.
struct ServeLoop::Conn {
  enum class Phase { kHello, kAuth, kServing };

  UniqueFd fd;
  Phase phase = Phase::kHello;
  bool authenticated = false;
  bool closing = false;  // close once the output is out
  ServerHandshake handshake;
  Deadline handshake_deadline;
  // The frame being read: its header, then its payload.
  uint8_t header[wire::kHeaderBytes] = {};
  size_t header_got = 0;
  wire::Header h;
  std::vector<uint8_t> payload;
  size_t payload_got = 0;
  std::unique_ptr<MemoryCharge> payload_charge;
  Deadline frame_deadline;
  // Output: small frames, or a DATA reply sent straight from registered memory.
  std::vector<uint8_t> out;
  size_t out_sent = 0;
  uint8_t data_header[wire::kHeaderBytes] = {};
  std::vector<iovec> iov;
  size_t iov_first = 0;
  std::unique_ptr<MemoryCharge> iov_charge;
  std::unique_ptr<CacheTable::Pin> pin;  // the reply's source stays registered
  uint64_t reply_bytes = 0;
  Clock::time_point last_progress;
  Deadline reply_deadline;
  uint32_t watched = 0;
  // A WRITE between WRITE_READY and its last byte; receiving_write once its DATA header came.
  std::unique_ptr<WriteIntake> write;
  bool receiving_write = false;
  ProvenWriter writer;
  uint64_t return_path = 0;  // the offer this control connection made, withdrawn at its close

  bool reading_frame() const { return header_got > 0; }
  bool output_pending() const { return out_sent < out.size() || iov_first < iov.size(); }
};

ServeLoop::ServeLoop(const ServeContext& context) : ctx_(context) {
  epoll_fd_.reset(::epoll_create1(EPOLL_CLOEXEC));
  wake_fd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!epoll_fd_.valid() || !wake_fd_.valid()) {
    throw std::system_error(errno, std::generic_category(), "epoll/eventfd");
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_.get();
  ::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, wake_fd_.get(), &ev);
  last_sweep_ = Clock::now();
  thread_ = std::thread([this] { run(); });
}

ServeLoop::~ServeLoop() { stop(); }

void ServeLoop::adopt(UniqueFd fd) {
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    if (stopping_) {
      ctx_.admissions->leave(false);
      return;  // the socket closes here
    }
    inbox_.push_back(std::move(fd));
  }
  count_++;
  signal_eventfd(wake_fd_.get());
}

void ServeLoop::stop() {
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  signal_eventfd(wake_fd_.get());
  if (thread_.joinable()) thread_.join();
}

void ServeLoop::run() {
  epoll_event events[kMaxEvents];
  for (;;) {
    int n = ::epoll_wait(epoll_fd_.get(), events, kMaxEvents, kSweepMs);
    if (n < 0 && errno != EINTR) break;
    for (int i = 0; i < n; ++i) {
      int fd = events[i].data.fd;
      if (fd == wake_fd_.get()) {
        uint64_t count = 0;
        ssize_t ignored = ::read(wake_fd_.get(), &count, sizeof(count));
        (void)ignored;
        continue;
      }
      auto it = conns_.find(fd);
      if (it != conns_.end()) on_event(*it->second, events[i].events);
    }
    {
      std::lock_guard<std::mutex> lock(inbox_mu_);
      if (stopping_) break;
    }
    take_inbox();
    if (Clock::now() - last_sweep_ >= std::chrono::milliseconds(kSweepMs)) sweep();
  }
  take_inbox();
  std::vector<int> fds;
  for (auto& [fd, conn] : conns_) fds.push_back(fd);
  for (int fd : fds) close(fd);
}

void ServeLoop::take_inbox() {
  std::vector<UniqueFd> taken;
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    taken.swap(inbox_);
  }
  for (UniqueFd& fd : taken) {
    auto conn = std::make_unique<Conn>();
    conn->fd = std::move(fd);
    conn->handshake_deadline = deadline_after_ms(wire::kHandshakeTimeoutMs);
    Conn& c = *conn;
    conns_.emplace(c.fd.get(), std::move(conn));
    if (ctx_.admissions->connections_full()) {
      // Refused before the handshake: it could only end in the same refusal.
      ctx_.stats->rejected_requests++;
      fail(c, status::kLinkBusy, ctx_.connections_full);
    }
    watch(c);
  }
}

void ServeLoop::watch(Conn& c) {
  // Not RDHUP while a reply is pending: a peer that shut its sending side would make it
  // fire on every wait; HUP and ERR still end the connection.
  uint32_t wanted = c.output_pending() ? EPOLLOUT : (EPOLLIN | EPOLLRDHUP);
  if (wanted == c.watched) return;
  epoll_event ev{};
  ev.events = wanted;
  ev.data.fd = c.fd.get();
  ::epoll_ctl(epoll_fd_.get(), c.watched == 0 ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, c.fd.get(), &ev);
  c.watched = wanted;
}

void ServeLoop::on_event(Conn& c, uint32_t events) {
  const int fd = c.fd.get();
  bool keep = true;
  // An exception must not escape the loop (that would end the process); it ends this
  // connection only.
  try {
    if (events & EPOLLOUT) keep = flush(c);
    if (keep && (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) && !c.output_pending()) {
      keep = read_frames(c);
    } else if (keep && (events & (EPOLLHUP | EPOLLERR))) {
      keep = false;  // the peer is gone while its reply was pending
    }
    if (keep && c.closing && !c.output_pending()) keep = false;
  } catch (const std::exception& e) {
    ctx_.stats->rejected_requests++;
    c.out.clear();
    c.out_sent = 0;
    c.iov.clear();
    c.iov_first = 0;
    queue_frame(c, wire::kError,
                wire::error_payload(status::kFailed, std::string("internal error: ") + e.what()));
    flush(c);
    keep = false;
  }
  if (!keep) {
    close(fd);
    return;
  }
  watch(c);
}

bool ServeLoop::read_frames(Conn& c) {
  while (!c.output_pending() && !c.closing) {
    if (c.receiving_write) {
      c.last_progress = Clock::now();
      int got = c.write->receive(c.fd.get());
      if (got < 0) {
        ctx_.stats->rejected_requests++;
        return false;
      }
      if (got == 0) return true;
      finish_write(c);
      if (!flush(c)) return false;
      continue;
    }
    if (c.header_got < wire::kHeaderBytes) {
      ssize_t r = ::recv(c.fd.get(), c.header + c.header_got, wire::kHeaderBytes - c.header_got, 0);
      if (r == 0) {
        // A close between frames is an unlink; inside one, or in the handshake, a refusal.
        if (c.reading_frame() || c.phase != Conn::Phase::kServing) {
          ctx_.stats->rejected_requests++;
        }
        return false;
      }
      if (r < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
      if (c.header_got == 0 && c.phase == Conn::Phase::kServing) {
        c.frame_deadline = deadline_after_ms(wire::kFrameTimeoutMs);
      }
      c.header_got += static_cast<size_t>(r);
      if (c.header_got < wire::kHeaderBytes) continue;
      uint32_t magic = 0;
      uint16_t version = 0;
      std::memcpy(&magic, c.header, 4);
      std::memcpy(&version, c.header + 4, 2);
      std::memcpy(&c.h.type, c.header + 6, 2);
      std::memcpy(&c.h.length, c.header + 8, 8);
      if (magic != wire::kMagic || version != wire::kVersion) {
        ctx_.stats->rejected_requests++;
        fail(c, c.phase == Conn::Phase::kServing ? status::kFailed : status::kLinkFailed,
             "bad frame: wrong magic or protocol version");
        return true;
      }
      if (c.write) {  // after WRITE_READY only the write's DATA frame may come
        if (!c.write->expects(c.h)) {
          ctx_.stats->rejected_requests++;
          c.write.reset();
          fail(c, status::kParamInvalid,
               "expected the DATA frame of the write, got frame type " +
                   std::to_string(c.h.type) + " of " + std::to_string(c.h.length) + " bytes");
          return true;
        }
        c.receiving_write = true;
        continue;
      }
      uint64_t limit = c.phase == Conn::Phase::kServing ? wire::kMaxControlPayload
                                                        : kHandshakeFrameBytes;
      if (c.h.length > limit) {
        ctx_.stats->rejected_requests++;
        fail(c, c.phase == Conn::Phase::kServing ? status::kParamInvalid : status::kLinkFailed,
             "frame of " + std::to_string(c.h.length) + " bytes exceeds the limit");
        return true;
      }
      c.payload.assign(c.h.length, 0);
      c.payload_got = 0;
      c.payload_charge = std::make_unique<MemoryCharge>(*ctx_.meter,
                                                        static_cast<int64_t>(c.h.length));
    }
    if (c.payload_got < c.payload.size()) {
      ssize_t r = ::recv(c.fd.get(), c.payload.data() + c.payload_got,
                         c.payload.size() - c.payload_got, 0);
      if (r == 0) {
        ctx_.stats->rejected_requests++;
        return false;
      }
      if (r < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
      c.payload_got += static_cast<size_t>(r);
      if (c.payload_got < c.payload.size()) continue;
    }
    bool keep = handle_frame(c);
    c.header_got = 0;
    c.payload.clear();
    c.payload.shrink_to_fit();
    c.payload_charge.reset();
    if (!keep) return false;
    if (c.output_pending() && !flush(c)) return false;
  }
  return true;
}

bool ServeLoop::handle_frame(Conn& c) {
  return c.phase == Conn::Phase::kServing ? handle_request(c) : handle_handshake(c);
}

bool ServeLoop::handle_handshake(Conn& c) {
  std::string why;
  if (c.phase == Conn::Phase::kHello) {
    std::vector<uint8_t> challenge;
    if (!c.handshake.on_hello(ctx_.identity, ctx_.token, c.h, c.payload, &challenge, &why)) {
      ctx_.stats->rejected_requests++;
      fail(c, status::kLinkFailed, why);
      return true;
    }
    queue_frame(c, wire::kChallenge, challenge);
    c.phase = Conn::Phase::kAuth;
    return true;
  }
  if (!c.handshake.on_auth(ctx_.token, c.h, c.payload, &why)) {
    ctx_.stats->rejected_requests++;
    fail(c, status::kLinkFailed, why);
    return true;
  }
  // The slot moves to the authenticated pool before WELCOME, so a full pool is refused in
  // place of WELCOME rather than after it.
  if (!ctx_.admissions->promote()) {
    ctx_.stats->rejected_requests++;
    fail(c, status::kLinkBusy, ctx_.connections_full);
    return true;
  }
  c.authenticated = true;
  c.phase = Conn::Phase::kServing;
  queue_frame(c, wire::kWelcome, welcome_payload(ctx_.identity));
  return true;
}

bool ServeLoop::handle_request(Conn& c) {
  if (c.h.type == wire::kRead) return start_read_reply(c);
  if (c.h.type == wire::kWrite) {
    start_write(c);
    return true;
  }
  if (c.h.type == wire::kTableRequest && c.payload.empty()) {
    queue_frame(c, wire::kTable, ctx_.table->encode_remote_visible());
    return true;
  }
  if (c.h.type == wire::kBye) {
    queue_frame(c, wire::kByeAck, {});
    c.closing = true;
    return true;
  }
  if (c.h.type == wire::kReturnPath && c.handshake.control_channel()) {
    take_return_path(c);
    return true;
  }
  ctx_.stats->rejected_requests++;
  fail(c, status::kParamInvalid, "unexpected frame type " + std::to_string(c.h.type));
  return true;
}

void ServeLoop::take_return_path(Conn& c) {
  wire::Decoder dec(c.payload.data(), c.payload.size());
  std::string host;
  uint32_t port = 0;
  if (!dec.str(&host) || !dec.u32(&port) || dec.remaining() != 0 || port == 0 ||
      port > 65535 || host.size() > 255) {
    ctx_.stats->rejected_requests++;
    fail(c, status::kParamInvalid, "malformed return path");
    return;
  }
  // "" is the address the linking engine reached us from: what we can reach it back at.
  if (host.empty()) host = wire::socket_host(c.fd.get(), true);
  if (host.empty()) {
    fail(c, status::kLinkFailed, "return path: the connection has no peer address");
    return;
  }
  const int64_t cluster = c.handshake.client_cluster();
  if (c.return_path != 0) ctx_.returns->withdraw(cluster, c.return_path);
  c.return_path = ctx_.returns->offer(cluster, host, static_cast<int>(port));
  queue_frame(c, wire::kReturnPathAck, {});
}

bool ServeLoop::start_read_reply(Conn& c) {
  wire::Decoder dec(c.payload.data(), c.payload.size());
  uint64_t serial = 0;
  uint32_t n = 0;
  if (!dec.u64(&serial) || !dec.u32(&n) || n == 0 || n > wire::kMaxReadOps ||
      dec.remaining() != uint64_t(n) * 16) {
    ctx_.stats->rejected_requests++;
    fail(c, status::kParamInvalid, "malformed read request");
    return true;
  }
  // The source stays registered until the reply is out; other caches stay unaffected.
  CacheTable::Pin source = ctx_.table->pin_remote_by_serial(serial);
  if (!source) {
    // The client planned from a copy of our table that names an unregistered cache.
    queue_frame(c, wire::kStale, {});
    return true;
  }
  std::vector<iovec> iov(size_t(n) + 1);  // [0] is the DATA header
  auto charge = std::make_unique<MemoryCharge>(*ctx_.meter,
                                               static_cast<int64_t>(iov.size() * sizeof(iovec)));
  uint64_t total = 0;
  for (uint32_t i = 0; i < n; ++i) {
    uint64_t addr = 0, len = 0;
    dec.u64(&addr);
    dec.u64(&len);
    if (!source.contains(addr, len)) {
      ctx_.stats->rejected_requests++;
      // The stream is still in step: keep serving.
      queue_frame(c, wire::kError,
                  wire::error_payload(status::kParamInvalid,
                                      "range [" + std::to_string(addr) + ", +" +
                                          std::to_string(len) +
                                          ") is outside the tensors of cache " +
                                          std::to_string(source.info().cache_id) +
                                          " of cluster " +
                                          std::to_string(ctx_.identity.cluster_id)));
      return true;
    }
    iov[i + 1] = {reinterpret_cast<void*>(addr), len};
    total += len;
  }
  wire::encode_header(c.data_header, wire::kData, total);
  iov[0] = {c.data_header, sizeof(c.data_header)};
  c.iov = std::move(iov);
  c.iov_first = 0;
  c.iov_charge = std::move(charge);
  c.pin = std::make_unique<CacheTable::Pin>(std::move(source));
  c.reply_bytes = total;
  c.last_progress = Clock::now();
  c.reply_deadline = deadline_after_ms(kReadReplyLimitMs);
  return true;
}

void ServeLoop::start_write(Conn& c) {
  Status refusal;
  uint64_t bytes = 0;
  switch (WriteIntake::start(c.payload, *ctx_.table, *ctx_.grants, c.handshake.client_cluster(),
                             &c.writer, ctx_.copiers, *ctx_.meter, &c.write, &refusal,
                             &bytes)) {
    case WriteIntake::Outcome::kRefused:
      ctx_.stats->rejected_requests++;
      queue_frame(c, wire::kError, wire::error_payload(refusal.code, refusal.message));
      return;
    case WriteIntake::Outcome::kStale:
      queue_frame(c, wire::kStale, {});
      return;
    case WriteIntake::Outcome::kAwaitData:
      queue_frame(c, wire::kWriteReady, {});
      c.reply_deadline = deadline_after_ms(kReadReplyLimitMs);
      return;
    case WriteIntake::Outcome::kDone:
      ctx_.stats->received_writes++;
      ctx_.stats->received_bytes += static_cast<int64_t>(bytes);
      ctx_.landed->note();
      queue_frame(c, wire::kWriteDone, {});
      return;
  }
}

void ServeLoop::finish_write(Conn& c) {
  ctx_.stats->received_writes++;
  ctx_.stats->received_bytes += static_cast<int64_t>(c.write->bytes());
  c.write.reset();  // unpins the destination
  ctx_.landed->note();
  c.receiving_write = false;
  c.header_got = 0;
  queue_frame(c, wire::kWriteDone, {});
}

void ServeLoop::queue_frame(Conn& c, uint16_t type, const std::vector<uint8_t>& payload) {
  if (c.out_sent == c.out.size()) {
    c.out.clear();
    c.out_sent = 0;
  }
  if (!c.output_pending()) c.last_progress = Clock::now();
  uint8_t header[wire::kHeaderBytes];
  wire::encode_header(header, type, payload.size());
  c.out.insert(c.out.end(), header, header + sizeof(header));
  c.out.insert(c.out.end(), payload.begin(), payload.end());
}

void ServeLoop::fail(Conn& c, int64_t code, const std::string& msg) {
  queue_frame(c, wire::kError, wire::error_payload(code, msg));
  c.closing = true;
}

bool ServeLoop::flush(Conn& c) {
  const int fd = c.fd.get();
  while (c.out_sent < c.out.size()) {
    ssize_t r = ::send(fd, c.out.data() + c.out_sent, c.out.size() - c.out_sent,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return true;
      return false;
    }
    c.out_sent += static_cast<size_t>(r);
    c.last_progress = Clock::now();
  }
  while (c.iov_first < c.iov.size()) {
    msghdr msg{};
    msg.msg_iov = c.iov.data() + c.iov_first;
    msg.msg_iovlen = std::min<size_t>(c.iov.size() - c.iov_first, IOV_MAX);
    ssize_t r = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return true;
      return false;
    }
    c.iov_first = wire::advance_iov(c.iov.data(), c.iov.size(), c.iov_first,
                                    static_cast<size_t>(r));
    c.last_progress = Clock::now();
  }
  if (!c.iov.empty()) {  // the DATA reply is out
    ctx_.stats->served_requests++;
    ctx_.stats->served_bytes += static_cast<int64_t>(c.reply_bytes);
    c.iov.clear();
    c.iov_first = 0;
    c.iov_charge.reset();
    c.pin.reset();
  }
  return true;
}

void ServeLoop::sweep() {
  const Clock::time_point now = Clock::now();
  last_sweep_ = now;
  const auto stall = std::chrono::milliseconds(wire::kSendStallTimeoutMs);
  std::vector<int> expired;
  for (auto& [fd, conn] : conns_) {
    Conn& c = *conn;
    if (c.phase != Conn::Phase::kServing) {
      // The whole handshake, replies included, within kHandshakeTimeoutMs of the accept.
      if (past(c.handshake_deadline)) {
        ctx_.stats->rejected_requests++;
        expired.push_back(fd);
      }
    } else if (c.output_pending()) {
      // A reply fails when its reader made no progress for the stall timeout (a slow reader
      // of a huge reply is fine) or held it past kReadReplyLimitMs (a trickle is not).
      bool reply = !c.iov.empty();
      if (now - c.last_progress >= stall || (reply && now >= c.reply_deadline)) {
        expired.push_back(fd);
      }
    } else if (c.write) {
      // A write holds its destination pinned: its DATA must keep arriving, and all of it
      // within kReadReplyLimitMs of WRITE_READY.
      if (now - c.last_progress >= stall || now >= c.reply_deadline) {
        ctx_.stats->rejected_requests++;
        expired.push_back(fd);
      }
    } else if (c.reading_frame() && past(c.frame_deadline)) {
      ctx_.stats->rejected_requests++;
      fail(c, status::kFailed, "bad frame: the frame did not arrive within " +
                                   std::to_string(wire::kFrameTimeoutMs) + " ms");
      if (!flush(c) || !c.output_pending()) {
        expired.push_back(fd);
      } else {
        watch(c);
      }
    }
  }
  for (int fd : expired) close(fd);
}

void ServeLoop::close(int fd) {
  auto it = conns_.find(fd);
  if (it == conns_.end()) return;
  std::unique_ptr<Conn> c = std::move(it->second);
  conns_.erase(it);
  if (c->return_path != 0) ctx_.returns->withdraw(c->handshake.client_cluster(), c->return_path);
  ::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, fd, nullptr);
  // Before the close, so a peer that sees it may count on the slot being free.
  ctx_.admissions->leave(c->authenticated);
  count_--;
  ::shutdown(fd, SHUT_RDWR);
  // The Conn (socket, pin, charges) goes here.
}

}  // namespace hixl
