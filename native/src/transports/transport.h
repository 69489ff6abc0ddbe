// One interface for moving a planned pull's bytes; one class per transport.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/handshake.h"
#include "common/planner.h"
#include "common/stats.h"
#include "common/thread_pool.h"
#include "common/wire.h"

namespace hixl {

// process_vm_readv takes at most this many iovecs per side in one call (UIO_MAXIOV).
constexpr size_t kIovMax = 1024;

// What a pull was planned from: the unregistration count of the peer's table copy and the
// serial of the source registration in it.
struct PlanBasis {
  uint64_t unregistrations = 0;
  uint64_t source_serial = 0;
};

// The peer's unregistration count as a transport last read it (0 when it cannot read it):
// a table fetched to settle plan::kStale or plan::kTableMoved must count at least as many.
struct PeerView {
  uint64_t unregistrations = 0;
};

// Internal results of Transport::pull; the engine turns them into a retry or a status code
// and never lets them reach a caller.
namespace plan {
// The copy of the peer's table may be stale and nothing usable was read: check which
// registrations survive, plan again.
constexpr int64_t kStale = -2;
// Every byte was read, but the peer unregistered a cache during the read: the data is good
// iff the source registration survived.
constexpr int64_t kTableMoved = -3;
}  // namespace plan

// The threads a same-host copy is spread over: `threads` of them, the calling thread and
// up to threads - 1 workers of `pool` (none: the caller alone).
struct Copiers {
  ThreadPool* pool = nullptr;
  int threads = 1;
};

// A link's control connection: one exchange (request and its reply) at a time.
struct ControlChannel {
  std::mutex mu;
  UniqueFd fd;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  // Copies every op's remote range into its local range before `deadline`. Returns TIMEOUT
  // when the deadline passed, FAILED on any transport error, plan::kStale or
  // plan::kTableMoved when the peer unregistered caches since `basis`, or the peer's refusal.
  virtual Status pull(const std::vector<Op>& ops, const PlanBasis& basis, Deadline deadline,
                      PeerView* seen) = 0;
  // Writes every op's local range into its remote range, all in the peer's registration
  // `dst_serial`, under the peer's write grant `grant` (0: none), before `deadline`. The
  // peer's server pins that registration and checks every range against it (and, for a
  // cache written by grant, against that grant) before a byte lands, so a write never
  // reaches memory the peer unregistered or did not grant. Returns plan::kStale when the
  // registration is gone, TIMEOUT, FAILED, or the peer's refusal.
  virtual Status push(const std::vector<Op>& ops, uint64_t dst_serial, uint64_t grant,
                      Deadline deadline) = 0;
  // Makes in-flight and later pulls fail fast (unlink, close, failure). Idempotent.
  virtual void abort() = 0;
  // False once the transport aborted itself or was aborted: the link cannot carry pulls.
  virtual bool usable() const = 0;
};

// Same-host reads with process_vm_readv from `pid`; `pidfd` guards against pid reuse, and
// the peer's unregistration count is read at `unregistrations_addr` around every pull.
// Writes go as WRITE requests on `control`: the peer copies the bytes in from `me`.
std::unique_ptr<Transport> make_cma_transport(int pid, UniqueFd pidfd,
                                              uint64_t unregistrations_addr,
                                              ControlChannel& control, const Identity& me,
                                              ThreadPool& pool, int threads,
                                              MemoryMeter& meter);
// Reads over `conns`, data connections already authenticated to the peer's server.
std::unique_ptr<Transport> make_tcp_transport(std::vector<UniqueFd> conns, ThreadPool& pool,
                                              MemoryMeter& meter);

// Copies every op's remote range in process `pid` into its local range, spread over
// `copiers`; FAILED when a range cannot be read or the process exited (`pidfd`), TIMEOUT
// past `deadline`.
Status cma_read(int pid, int pidfd, const std::vector<Op>& ops, Deadline deadline,
                const Copiers& copiers, MemoryMeter& meter);

// Link-time probe: opens a pidfd for `pid` and reads `len` bytes at `addr` of that process,
// expecting `expected`. On success *pidfd holds the peer's pidfd.
Status cma_probe(int pid, uint64_t addr, const uint8_t* expected, size_t len, UniqueFd* pidfd);

}  // namespace hixl
