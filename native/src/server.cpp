#include "server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>

namespace hixl {
namespace {

std::runtime_error bind_error(const std::string& host, int port, const std::string& why) {
  return std::runtime_error("cannot listen on " + host + ":" + std::to_string(port) + ": " + why);
}

std::string limit_message(const char* what, int limit) {
  return "server busy: " + std::to_string(limit) + " connections " + what +
         " already (its limit); try again later";
}

// For a socket the accept thread refuses: one attempt, never blocks (a fresh socket's send
// buffer is empty, so the frame normally fits at once).
void refuse_without_waiting(int fd, const std::string& msg) {
  wire::send_frame(fd, wire::kError, wire::error_payload(status::kLinkBusy, msg),
                   deadline_after_ms(0));
}

void signal_eventfd(int fd) {
  uint64_t one = 1;
  ssize_t ignored = ::write(fd, &one, sizeof(one));
  (void)ignored;
}

}  // namespace

Server::Server(const std::string& host, int port, Identity identity, std::string token,
               CacheTable& table, EngineStats& stats, MemoryMeter& meter)
    : identity_(std::move(identity)),
      token_(std::move(token)),
      table_(table),
      stats_(stats),
      meter_(meter) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string port_text = std::to_string(port);
  int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port_text.c_str(), &hints, &res);
  if (rc != 0) throw bind_error(host, port, ::gai_strerror(rc));
  std::string why = "no usable address";
  for (addrinfo* ai = res; ai != nullptr && !listen_fd_.valid(); ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd.valid()) continue;
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd.get(), 128) != 0) {
      why = std::strerror(errno);
      continue;
    }
    listen_fd_ = std::move(fd);
  }
  ::freeaddrinfo(res);
  if (!listen_fd_.valid()) throw bind_error(host, port, why);
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(listen_fd_.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  wake_fd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  finished_fd_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_.valid() || !finished_fd_.valid()) {
    throw bind_error(host, port, std::string("eventfd: ") + std::strerror(errno));
  }
  wire::set_nonblocking(listen_fd_.get());
  accept_thread_ = std::thread([this] { accept_loop(); });
}

Server::~Server() { stop(); }

void Server::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  signal_eventfd(wake_fd_.get());
  if (accept_thread_.joinable()) accept_thread_.join();
  std::list<std::unique_ptr<Connection>> conns;
  {
    std::lock_guard<std::mutex> lock(mu_);
    conns.swap(connections_);
  }
  for (auto& c : conns) ::shutdown(c->fd.get(), SHUT_RDWR);
  for (auto& c : conns) {
    if (c->thread.joinable()) c->thread.join();
  }
  listen_fd_.reset();
}

void Server::reap_finished_locked() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if ((*it)->done.load()) {
      (*it)->thread.join();
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

void Server::accept_loop() {
  for (;;) {
    pollfd fds[3] = {{listen_fd_.get(), POLLIN, 0},
                     {wake_fd_.get(), POLLIN, 0},
                     {finished_fd_.get(), POLLIN, 0}};
    int r = ::poll(fds, 3, -1);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 || (fds[1].revents & POLLIN)) return;
    if (fds[2].revents & POLLIN) {
      // A finished connection's thread and socket go now, not at the next accept, which
      // may never come.
      uint64_t count = 0;
      ssize_t ignored = ::read(finished_fd_.get(), &count, sizeof(count));
      (void)ignored;
      std::lock_guard<std::mutex> lock(mu_);
      reap_finished_locked();
    }
    if (!(fds[0].revents & POLLIN)) continue;
    UniqueFd fd(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd.valid()) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        pollfd wake{wake_fd_.get(), POLLIN, 0};
        ::poll(&wake, 1, 100);  // out of descriptors: back off instead of spinning
      }
      continue;
    }
    std::lock_guard<std::mutex> lock(mu_);
    reap_finished_locked();
    if (handshaking_ >= kMaxHandshaking) {
      // Sockets that never finish their handshake (no token, or a flood) only ever hold
      // these slots, never the authenticated ones real links need.
      stats_.rejected_requests++;
      refuse_without_waiting(fd.get(), limit_message("in the handshake", kMaxHandshaking));
      continue;  // closing the socket is the refusal
    }
    wire::set_nodelay(fd.get());
    wire::set_keepalive(fd.get());
    auto conn = std::make_unique<Connection>();
    conn->fd = std::move(fd);
    Connection* raw = conn.get();
    try {
      conn->thread = std::thread([this, raw] { serve(raw); });
    } catch (const std::system_error&) {  // out of threads: refuse this one, keep serving
      stats_.rejected_requests++;
      continue;
    }
    handshaking_++;
    connections_.push_back(std::move(conn));
  }
}

void Server::send_error(int fd, int64_t code, const std::string& msg) {
  wire::send_frame(fd, wire::kError, wire::error_payload(code, msg),
                   deadline_after_ms(wire::kFrameTimeoutMs));
}

void Server::serve(Connection* conn) {
  const int fd = conn->fd.get();
  bool authenticated = false;
  // An exception must not escape a connection thread (that would end the process); it
  // ends this connection only.
  try {
    serve_connection(fd, &authenticated);
  } catch (const std::exception& e) {
    stats_.rejected_requests++;
    send_error(fd, status::kFailed, std::string("internal error: ") + e.what());
  }
  {
    // Before the shutdown, so a peer that sees the close may count on the slot being free.
    std::lock_guard<std::mutex> lock(mu_);
    (authenticated ? authenticated_ : handshaking_)--;
  }
  ::shutdown(fd, SHUT_RDWR);  // the peer sees the close now; the fd is closed when reaped
  conn->done.store(true);
  signal_eventfd(finished_fd_.get());  // after `done`, so the accept thread reaps this one
}

void Server::serve_connection(int fd, bool* authenticated) {
  bool full = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    full = authenticated_ >= kMaxConnections;
  }
  if (full) {  // refuse before the handshake: it could only end in the same refusal
    stats_.rejected_requests++;
    send_error(fd, status::kLinkBusy, limit_message("authenticated", kMaxConnections));
  } else {
    // The slot moves to the authenticated pool before WELCOME, so a full pool is refused
    // in place of WELCOME rather than after it.
    auto admit = [&]() -> std::string {
      *authenticated = admit_authenticated();
      return *authenticated ? "" : limit_message("authenticated", kMaxConnections);
    };
    bool auth_refused = false;
    std::string e = server_handshake(fd, identity_, token_,
                                     deadline_after_ms(wire::kHandshakeTimeoutMs), admit,
                                     &auth_refused);
    if (!e.empty()) stats_.rejected_requests++;
    if (*authenticated && e.empty()) serve_requests(fd);
  }
}

bool Server::admit_authenticated() {
  std::lock_guard<std::mutex> lock(mu_);
  if (authenticated_ >= kMaxConnections) return false;
  handshaking_--;
  authenticated_++;
  return true;
}

void Server::serve_requests(int fd) {
  for (;;) {
    // Idle authenticated connections may wait indefinitely (stop() wakes them with shutdown,
    // keepalive notices a vanished peer); once a frame starts it must complete within
    // kFrameTimeoutMs.
    pollfd p{fd, POLLIN, 0};
    int r = ::poll(&p, 1, -1);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 || (p.revents & (POLLERR | POLLNVAL))) break;
    wire::Header h;
    Deadline deadline = deadline_after_ms(wire::kFrameTimeoutMs);
    wire::IoResult io = wire::recv_header(fd, &h, deadline);
    if (!io.ok()) {
      if (io.error != wire::IoError::kPeerClosed) {  // a close between frames is an unlink
        stats_.rejected_requests++;
        send_error(fd, status::kFailed, "bad frame: " + io.reason);
      }
      break;
    }
    if (h.length > wire::kMaxControlPayload) {
      stats_.rejected_requests++;
      send_error(fd, status::kParamInvalid,
                 "frame of " + std::to_string(h.length) + " bytes exceeds the limit");
      break;
    }
    std::vector<uint8_t> payload(h.length);
    MemoryCharge charge(meter_, static_cast<int64_t>(payload.size()));
    if (!wire::recv_all(fd, payload.data(), payload.size(), deadline).ok()) {
      stats_.rejected_requests++;
      break;
    }
    if (h.type == wire::kRead) {
      if (!handle_read(fd, payload)) break;
    } else if (h.type == wire::kTableRequest && payload.empty()) {
      std::vector<uint8_t> table = table_.encode_remote_visible();
      if (!wire::send_frame(fd, wire::kTable, table,
                            deadline_after_ms(wire::kSendStallTimeoutMs))
               .ok()) {
        break;
      }
    } else if (h.type == wire::kBye) {
      wire::send_frame(fd, wire::kByeAck, {}, deadline);
      break;
    } else {
      stats_.rejected_requests++;
      send_error(fd, status::kParamInvalid, "unexpected frame type " + std::to_string(h.type));
      break;
    }
  }
}

bool Server::handle_read(int fd, const std::vector<uint8_t>& payload) {
  wire::Decoder dec(payload.data(), payload.size());
  uint64_t serial = 0;
  uint32_t n = 0;
  if (!dec.u64(&serial) || !dec.u32(&n) || n == 0 || n > wire::kMaxReadOps ||
      dec.remaining() != uint64_t(n) * 16) {
    stats_.rejected_requests++;
    send_error(fd, status::kParamInvalid, "malformed read request");
    return false;
  }
  std::vector<iovec> iov(size_t(n) + 1);  // [0] is the DATA header
  MemoryCharge charge(meter_, static_cast<int64_t>(iov.size() * sizeof(iovec)));
  uint64_t total = 0;
  // The source stays registered until the reply is out; other caches stay unaffected.
  const CacheTable::Pin source = table_.pin_remote_by_serial(serial);
  if (!source) {
    // The client planned from a copy of our table that names an unregistered cache.
    return wire::send_frame(fd, wire::kStale, {}, deadline_after_ms(wire::kFrameTimeoutMs)).ok();
  }
  for (uint32_t i = 0; i < n; ++i) {
    uint64_t addr = 0, len = 0;
    dec.u64(&addr);
    dec.u64(&len);
    if (!source.contains(addr, len)) {
      stats_.rejected_requests++;
      send_error(fd, status::kParamInvalid,
                 "range [" + std::to_string(addr) + ", +" + std::to_string(len) +
                     ") is outside the tensors of cache " + std::to_string(source.info().cache_id) +
                     " of cluster " + std::to_string(identity_.cluster_id));
      return true;  // the stream is still in sync: keep serving
    }
    iov[i + 1] = {reinterpret_cast<void*>(addr), len};
    total += len;
  }
  uint8_t header[wire::kHeaderBytes];
  uint32_t magic = wire::kMagic;
  uint16_t version = wire::kVersion, type = wire::kData;
  std::memcpy(header, &magic, 4);
  std::memcpy(header + 4, &version, 2);
  std::memcpy(header + 6, &type, 2);
  std::memcpy(header + 8, &total, 8);
  iov[0] = {header, sizeof(header)};
  // The reply fails only when the reader makes no progress for the stall timeout (a slow
  // reader of a huge reply is fine) or holds it past kReadReplyLimitMs (a trickle is not).
  if (!wire::sendv_all_with_stall(fd, iov.data(), iov.size(), wire::kSendStallTimeoutMs,
                                  deadline_after_ms(kReadReplyLimitMs))
           .ok()) {
    return false;
  }
  stats_.served_requests++;
  stats_.served_bytes += static_cast<int64_t>(total);
  return true;
}

}  // namespace hixl
