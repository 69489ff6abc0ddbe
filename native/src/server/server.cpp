#include "server/server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>

namespace hixl {
namespace {

std::runtime_error bind_error(const std::string& host, int port, const std::string& why) {
  return std::runtime_error("cannot listen on " + host + ":" + std::to_string(port) + ": " + why);
}

std::string limit_message(int limit, const char* what, const char* option) {
  return "server busy: " + std::to_string(limit) + " connections " + what +
         " already (its limit; the serving engine's option " + option +
         " raises it); try again later";
}

// For a socket the accept thread refuses: one attempt, never blocks (a fresh socket's send
// buffer is empty, so the frame normally fits at once).
void refuse_without_waiting(int fd, const std::string& msg) {
  wire::send_frame(fd, wire::kError, wire::error_payload(status::kLinkBusy, msg),
                   deadline_after_ms(0));
}

int loop_count(int requested) {
  if (requested > 0) return requested;
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(cores, 1, ServerLimits::kMaxDefaultThreads);
}

}  // namespace

Server::Server(const std::string& host, int port, const ServeContext& engine,
               const ServerLimits& limits)
    : admissions_(limits.max_handshaking, limits.max_connections), context_(engine) {
  context_.admissions = &admissions_;
  context_.handshakes_full =
      limit_message(limits.max_handshaking, "in the handshake", "hixl.serverHandshakes");
  context_.connections_full =
      limit_message(limits.max_connections, "authenticated", "hixl.serverConnections");
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
    // A burst of links waits in the kernel's queue for its turn rather than being dropped.
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd.get(), SOMAXCONN) != 0) {
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
  if (!wake_fd_.valid()) {
    throw bind_error(host, port, std::string("eventfd: ") + std::strerror(errno));
  }
  wire::set_nonblocking(listen_fd_.get());
  try {
    for (int i = 0; i < loop_count(limits.threads); ++i) {
      loops_.push_back(std::make_unique<ServeLoop>(context_));
    }
  } catch (const std::system_error& e) {
    loops_.clear();
    throw bind_error(host, port, std::string("cannot start the serving threads: ") + e.what());
  }
  accept_thread_ = std::thread([this] { accept_loop(); });
}

Server::~Server() { stop(); }

void Server::stop() {
  if (stopped_) return;
  stopped_ = true;
  uint64_t one = 1;
  ssize_t ignored = ::write(wake_fd_.get(), &one, sizeof(one));
  (void)ignored;
  if (accept_thread_.joinable()) accept_thread_.join();
  for (auto& loop : loops_) loop->stop();
  listen_fd_.reset();
}

ServeLoop& Server::least_loaded() {
  return **std::min_element(loops_.begin(), loops_.end(), [](const auto& a, const auto& b) {
    return a->connections() < b->connections();
  });
}

void Server::accept_loop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_.get(), POLLIN, 0}, {wake_fd_.get(), POLLIN, 0}};
    int r = ::poll(fds, 2, -1);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 || (fds[1].revents & POLLIN)) return;
    if (!(fds[0].revents & POLLIN)) continue;
    UniqueFd fd(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd.valid()) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        pollfd wake{wake_fd_.get(), POLLIN, 0};
        ::poll(&wake, 1, 100);  // out of descriptors: back off instead of spinning
      }
      continue;
    }
    if (!admissions_.enter_handshake()) {
      // Sockets that never finish their handshake (no token, or a flood) only ever hold
      // these slots, never the authenticated ones real links need.
      context_.stats->rejected_requests++;
      refuse_without_waiting(fd.get(), context_.handshakes_full);
      continue;  // closing the socket is the refusal
    }
    wire::set_nodelay(fd.get());
    wire::set_keepalive(fd.get());
    least_loaded().adopt(std::move(fd));
  }
}

}  // namespace hixl
