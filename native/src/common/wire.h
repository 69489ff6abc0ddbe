// Wire format (framing + little-endian encoding) and deadline-bounded socket I/O.
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "hixl/engine.h"

namespace hixl {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

Deadline deadline_after_ms(int64_t ms);
int remaining_ms(Deadline deadline);  // >= 0, rounded up

// Owns a file descriptor; closes it once.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

namespace wire {

constexpr uint32_t kMagic = 0x4C584948;  // "HIXL" little-endian
constexpr uint16_t kVersion = 4;  // 4: WRITE names its write grant
constexpr size_t kHeaderBytes = 16;
constexpr uint64_t kMaxControlPayload = 4u << 20;
constexpr uint64_t kMaxTablePayload = 16u << 20;
constexpr uint32_t kMaxReadOps = 65536;
constexpr uint32_t kMaxStringBytes = 4096;
constexpr size_t kNonceBytes = 32;
constexpr int kHandshakeTimeoutMs = 5000;
constexpr int kFrameTimeoutMs = 5000;
constexpr int kSendStallTimeoutMs = 10000;
// Keepalive on every engine socket: an idle connection whose peer vanished (host down, cable
// pulled, no RST) is detected after about kKeepAliveIdleS + kKeepAliveIntervalS * kKeepAliveCount
// seconds; unacknowledged sends fail after kUserTimeoutMs.
constexpr int kKeepAliveIdleS = 30;
constexpr int kKeepAliveIntervalS = 5;
constexpr int kKeepAliveCount = 6;
constexpr int kUserTimeoutMs = 60000;

enum FrameType : uint16_t {
  kHello = 1,       // c->s: i64 client cluster, i64 expected server cluster, u8 channel, nonce
  kChallenge = 2,   // s->c: u8 server has token, server nonce, server proof
  kAuth = 3,        // c->s: client proof
  kWelcome = 4,     // s->c: identity (cluster, pid, pidns, boot id, host, probe, addr of the
                    // table's unregistration count)
  kTableRequest = 5,
  kTable = 6,
  kRead = 7,        // c->s: u64 source cache serial, u32 n, n x (u64 addr, u64 len)
  kData = 8,        // s->c: raw bytes follow, length = sum of the request's lengths
  kBye = 9,
  kByeAck = 10,
  kStale = 11,      // s->c: the READ or WRITE named a registration that is gone; refetch
  // c->s: u64 destination serial, u64 write grant (0: none), u8 source (WriteSource), u32 n,
  // n x (u64 addr, u64 len); kFromWriter adds n x u64 source addr, i64 pid, u64 probe addr and the probe's bytes.
  kWrite = 12,
  kWriteReady = 13,  // s->c: the ranges are pinned and checked; send the DATA frame
  kWriteDone = 14,   // s->c: every byte of the write landed
  kError = 15,      // u64 status code, string message
  // c->s on the control connection: string host ("" = the address this connection comes
  // from), u32 port: where the server's engine may link back to this one (return_paths.h).
  kReturnPath = 16,
  kReturnPathAck = 17,
};

enum Channel : uint8_t { kControlChannel = 0, kDataChannel = 1 };

// Where a WRITE's bytes come from: a DATA frame after WRITE_READY on the same connection, or
// the writer's own memory on this host, which the destination's server copies in itself.
enum WriteSource : uint8_t { kBytesFollow = 0, kFromWriter = 1 };

// Why a socket operation or a frame failed. Callers branch on this, never on the reason text.
enum class IoError : uint8_t {
  kNone = 0,
  kTimedOut,    // the deadline, or a send's stall bound, passed
  kPeerClosed,  // the peer closed the connection (end of stream)
  kSocket,      // a system call failed (reset, broken pipe, ...)
  kBadHeader,   // wrong magic or protocol version
  kTooLarge,    // the payload exceeds the limit the caller set
};

// Outcome of a wire operation: ok, or the error and a reason fit for messages.
struct IoResult {
  IoError error = IoError::kNone;
  std::string reason;

  bool ok() const { return error == IoError::kNone; }
  bool timed_out() const { return error == IoError::kTimedOut; }
  static IoResult Ok() { return {}; }
  static IoResult Fail(IoError e, std::string why) { return {e, std::move(why)}; }
};

struct Header {
  uint16_t type = 0;
  uint64_t length = 0;
};

class Encoder {
 public:
  void u8(uint8_t v) { buf_.push_back(v); }
  void u32(uint32_t v) { raw(&v, 4); }
  void u64(uint64_t v) { raw(&v, 8); }
  void i64(int64_t v) { raw(&v, 8); }
  void str(const std::string& s);
  void raw(const void* p, size_t n);
  std::vector<uint8_t>& bytes() { return buf_; }

 private:
  std::vector<uint8_t> buf_;
};

// Every getter fails (returns false) instead of reading past the end.
class Decoder {
 public:
  Decoder(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  bool u8(uint8_t* v) { return raw(v, 1); }
  bool u32(uint32_t* v) { return raw(v, 4); }
  bool u64(uint64_t* v) { return raw(v, 8); }
  bool i64(int64_t* v) { return raw(v, 8); }
  bool str(std::string* s);
  bool raw(void* out, size_t n);
  size_t remaining() const { return n_ - pos_; }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

// Deadline-bounded I/O on a non-blocking socket.
IoResult send_all(int fd, const void* data, size_t len, Deadline deadline);
IoResult sendv_all(int fd, iovec* iov, size_t count, Deadline deadline);
// sendv_all for long replies to a reader of unknown speed: fails when no byte could be sent for
// stall_ms (every byte sent restarts that clock) or when `deadline` passes, whichever is first.
IoResult sendv_all_with_stall(int fd, iovec* iov, size_t count, int stall_ms,
                              Deadline deadline);
IoResult recv_all(int fd, void* data, size_t len, Deadline deadline);
IoResult recvv_all(int fd, iovec* iov, size_t count, Deadline deadline);
// recvv_all for bulk data: while more than 4 x low_water_bytes are still expected, the socket
// reports readable only once low_water_bytes are queued (SO_RCVLOWAT), which saves a wake-up
// and a readv per loopback segment; the mark is back at 1 byte on return.
IoResult recvv_bulk(int fd, iovec* iov, size_t count, int low_water_bytes,
                    Deadline deadline);

// Writes a frame header (kHeaderBytes) for a payload of `length` bytes.
void encode_header(uint8_t* out, uint16_t type, uint64_t length);
IoResult send_frame(int fd, uint16_t type, const std::vector<uint8_t>& payload,
                    Deadline deadline);
IoResult recv_header(int fd, Header* header, Deadline deadline);
// Reads a whole frame whose payload must not exceed max_payload.
IoResult recv_frame(int fd, Header* header, std::vector<uint8_t>* payload,
                    uint64_t max_payload, Deadline deadline);
std::vector<uint8_t> error_payload(int64_t code, const std::string& message);
Status decode_error(const std::vector<uint8_t>& payload, const std::string& context);

UniqueFd connect_to(const std::string& host, int port, Deadline deadline, std::string* error);
// The numeric address of a connected socket's own end (`peer` false) or its peer's; "" when
// the socket has none.
std::string socket_host(int fd, bool peer);
// Advances an iovec array by n bytes from index `first`; returns the new first index.
size_t advance_iov(iovec* iov, size_t count, size_t first, size_t n);
void set_nonblocking(int fd);
void set_nodelay(int fd);
// SO_KEEPALIVE with the kKeepAlive* timings and TCP_USER_TIMEOUT = kUserTimeoutMs.
void set_keepalive(int fd);
// Bytes that must be queued before a poll for input reports the socket readable (1 = any).
void set_receive_low_water(int fd, int bytes);
// Fills with kernel randomness; throws std::system_error when getrandom fails.
void fill_random(void* out, size_t n);

}  // namespace wire
}  // namespace hixl
