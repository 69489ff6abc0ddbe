#include "common/wire.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>

namespace hixl {

Deadline deadline_after_ms(int64_t ms) { return Clock::now() + std::chrono::milliseconds(ms); }

int remaining_ms(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  int64_t ms = (left.count() + 999) / 1000;
  return static_cast<int>(std::min<int64_t>(ms, 1 << 30));
}

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) reset(o.release());
  return *this;
}

int UniqueFd::release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

namespace wire {

void Encoder::str(const std::string& s) {
  u32(static_cast<uint32_t>(s.size()));
  raw(s.data(), s.size());
}

void Encoder::raw(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  buf_.insert(buf_.end(), b, b + n);
}

bool Decoder::raw(void* out, size_t n) {
  if (n > n_ - pos_) return false;
  std::memcpy(out, p_ + pos_, n);
  pos_ += n;
  return true;
}

bool Decoder::str(std::string* s) {
  uint32_t len = 0;
  if (!u32(&len) || len > kMaxStringBytes || len > remaining()) return false;
  s->assign(reinterpret_cast<const char*>(p_ + pos_), len);
  pos_ += len;
  return true;
}

namespace {

IoResult system_failure(const char* call) {
  return IoResult::Fail(IoError::kSocket, std::string(call) + ": " + std::strerror(errno));
}

// Waits until fd is ready for `events`.
IoResult wait_ready(int fd, short events, Deadline deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int ms = remaining_ms(deadline);
    if (ms == 0) return IoResult::Fail(IoError::kTimedOut, "timed out");
    int r = ::poll(&p, 1, ms);
    if (r > 0) return IoResult::Ok();
    if (r == 0) continue;  // re-check the deadline
    if (errno != EINTR) return system_failure("poll");
  }
}

constexpr size_t kIovBatch = 1024;

}  // namespace

size_t advance_iov(iovec* iov, size_t count, size_t first, size_t n) {
  while (n > 0 && first < count) {
    if (n >= iov[first].iov_len) {
      n -= iov[first].iov_len;
      iov[first].iov_len = 0;
      ++first;
    } else {
      iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + n;
      iov[first].iov_len -= n;
      n = 0;
    }
  }
  while (first < count && iov[first].iov_len == 0) ++first;
  return first;
}

namespace {

// Sends every byte; stall_ms < 0 means no stall bound (only `deadline`).
IoResult sendv(int fd, iovec* iov, size_t count, int stall_ms, Deadline deadline) {
  size_t first = advance_iov(iov, count, 0, 0);
  Deadline stall = stall_ms < 0 ? deadline : std::min(deadline, deadline_after_ms(stall_ms));
  while (first < count) {
    msghdr msg{};
    msg.msg_iov = iov + first;
    msg.msg_iovlen = std::min(count - first, kIovBatch);
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      first = advance_iov(iov, count, first, static_cast<size_t>(n));
      if (stall_ms >= 0) stall = std::min(deadline, deadline_after_ms(stall_ms));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      IoResult ready = wait_ready(fd, POLLOUT, stall);
      if (ready.timed_out() && stall < deadline) {
        return IoResult::Fail(IoError::kTimedOut,
                              "no progress for " + std::to_string(stall_ms) + " ms");
      }
      if (!ready.ok()) return ready;
      continue;
    }
    if (n < 0) return system_failure("send");
    return IoResult::Fail(IoError::kPeerClosed, "send: connection closed");
  }
  return IoResult::Ok();
}

}  // namespace

IoResult sendv_all(int fd, iovec* iov, size_t count, Deadline deadline) {
  return sendv(fd, iov, count, -1, deadline);
}

IoResult sendv_all_with_stall(int fd, iovec* iov, size_t count, int stall_ms,
                              Deadline deadline) {
  return sendv(fd, iov, count, std::max(0, stall_ms), deadline);
}

namespace {

IoResult recvv(int fd, iovec* iov, size_t count, int low_water_bytes, Deadline deadline) {
  size_t first = advance_iov(iov, count, 0, 0);
  uint64_t left = 0;
  for (size_t i = first; i < count; ++i) left += iov[i].iov_len;
  int low_water = 1;
  IoResult result;
  while (first < count) {
    ssize_t n = ::readv(fd, iov + first, static_cast<int>(std::min(count - first, kIovBatch)));
    if (n > 0) {
      first = advance_iov(iov, count, first, static_cast<size_t>(n));
      left -= static_cast<uint64_t>(n);
      continue;
    }
    if (n == 0) {
      result = IoResult::Fail(IoError::kPeerClosed, "connection closed by peer");
      break;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      result = system_failure("recv");
      break;
    }
    // Batch wake-ups while much is still expected; near the end (and never above what is
    // still expected, or poll would wait for bytes never sent) wake on every byte again, so
    // the last bytes are copied while the sender finishes.
    int want = left > 4 * static_cast<uint64_t>(low_water_bytes) ? low_water_bytes : 1;
    if (want != low_water) {
      set_receive_low_water(fd, want);
      low_water = want;
    }
    result = wait_ready(fd, POLLIN, deadline);
    if (!result.ok()) break;
  }
  if (low_water != 1) set_receive_low_water(fd, 1);
  return result;
}

}  // namespace

IoResult recvv_all(int fd, iovec* iov, size_t count, Deadline deadline) {
  return recvv(fd, iov, count, 1, deadline);
}

IoResult recvv_bulk(int fd, iovec* iov, size_t count, int low_water_bytes, Deadline deadline) {
  return recvv(fd, iov, count, std::max(1, low_water_bytes), deadline);
}

IoResult send_all(int fd, const void* data, size_t len, Deadline deadline) {
  iovec iov{const_cast<void*>(data), len};
  return sendv_all(fd, &iov, 1, deadline);
}

IoResult recv_all(int fd, void* data, size_t len, Deadline deadline) {
  iovec iov{data, len};
  return recvv_all(fd, &iov, 1, deadline);
}

void encode_header(uint8_t* out, uint16_t type, uint64_t length) {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  std::memcpy(out, &magic, 4);
  std::memcpy(out + 4, &version, 2);
  std::memcpy(out + 6, &type, 2);
  std::memcpy(out + 8, &length, 8);
}

IoResult send_frame(int fd, uint16_t type, const std::vector<uint8_t>& payload,
                    Deadline deadline) {
  uint8_t header[kHeaderBytes];
  encode_header(header, type, payload.size());
  iovec iov[2] = {{header, kHeaderBytes},
                  {const_cast<uint8_t*>(payload.data()), payload.size()}};
  return sendv_all(fd, iov, payload.empty() ? 1 : 2, deadline);
}

IoResult recv_header(int fd, Header* header, Deadline deadline) {
  uint8_t raw[kHeaderBytes];
  IoResult r = recv_all(fd, raw, kHeaderBytes, deadline);
  if (!r.ok()) return r;
  uint32_t magic = 0;
  uint16_t version = 0;
  std::memcpy(&magic, raw, 4);
  std::memcpy(&version, raw + 4, 2);
  std::memcpy(&header->type, raw + 6, 2);
  std::memcpy(&header->length, raw + 8, 8);
  if (magic != kMagic) return IoResult::Fail(IoError::kBadHeader, "bad frame magic");
  if (version != kVersion) {
    return IoResult::Fail(IoError::kBadHeader,
                          "unsupported protocol version " + std::to_string(version));
  }
  return IoResult::Ok();
}

IoResult recv_frame(int fd, Header* header, std::vector<uint8_t>* payload,
                    uint64_t max_payload, Deadline deadline) {
  IoResult r = recv_header(fd, header, deadline);
  if (!r.ok()) return r;
  if (header->length > max_payload) {
    return IoResult::Fail(IoError::kTooLarge, "frame of " + std::to_string(header->length) +
                                                  " bytes exceeds limit " +
                                                  std::to_string(max_payload));
  }
  payload->resize(header->length);
  return recv_all(fd, payload->data(), payload->size(), deadline);
}

std::vector<uint8_t> error_payload(int64_t code, const std::string& message) {
  Encoder enc;
  enc.u64(static_cast<uint64_t>(code));
  enc.str(message.size() > kMaxStringBytes ? message.substr(0, kMaxStringBytes) : message);
  return std::move(enc.bytes());
}

Status decode_error(const std::vector<uint8_t>& payload, const std::string& context) {
  Decoder dec(payload.data(), payload.size());
  uint64_t code = 0;
  std::string msg;
  if (!dec.u64(&code) || !dec.str(&msg)) {
    return Status::Error(status::kFailed, context + ": malformed error frame");
  }
  int64_t c = static_cast<int64_t>(code);
  if (c == status::kSuccess || c == status::kPending) c = status::kFailed;
  return Status::Error(c, context + ": " + msg);
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void set_keepalive(int fd) {
  int one = 1, idle = kKeepAliveIdleS, interval = kKeepAliveIntervalS, probes = kKeepAliveCount;
  unsigned int user_timeout = kUserTimeoutMs;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof(user_timeout));
}

void set_receive_low_water(int fd, int bytes) {
  ::setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &bytes, sizeof(bytes));
}

void fill_random(void* out, size_t n) {
  auto* p = static_cast<uint8_t*>(out);
  while (n > 0) {
    ssize_t r = ::getrandom(p, n, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      // A nonce or probe left partly zero would be guessable: never hand one out.
      throw std::system_error(errno, std::generic_category(), "getrandom");
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
}

std::string socket_host(int fd, bool peer) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  auto* sa = reinterpret_cast<sockaddr*>(&addr);
  if ((peer ? ::getpeername(fd, sa, &len) : ::getsockname(fd, sa, &len)) != 0) return "";
  char host[NI_MAXHOST] = {};
  if (::getnameinfo(sa, len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) return "";
  return host;
}

UniqueFd connect_to(const std::string& host, int port, Deadline deadline, std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::string port_text = std::to_string(port);
  int rc = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &res);
  if (rc != 0) {
    *error = "cannot resolve " + host + ": " + ::gai_strerror(rc);
    return UniqueFd();
  }
  std::string last = "no address";
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd.valid()) continue;
    set_nonblocking(fd.get());
    int r = ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen);
    if (r != 0 && errno == EINPROGRESS) {
      IoResult ready = wait_ready(fd.get(), POLLOUT, deadline);
      if (!ready.ok()) {
        last = "connect " + ready.reason;
        continue;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      r = err == 0 ? 0 : -1;
      errno = err;
    }
    if (r != 0) {
      last = std::string("connect: ") + std::strerror(errno);
      continue;
    }
    set_nodelay(fd.get());
    set_keepalive(fd.get());
    ::freeaddrinfo(res);
    return fd;
  }
  ::freeaddrinfo(res);
  *error = "cannot connect to " + host + ":" + port_text + " (" + last + ")";
  return UniqueFd();
}

}  // namespace wire
}  // namespace hixl
