// One interface for moving a planned pull's bytes; one class per transport.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "planner.h"
#include "stats.h"
#include "thread_pool.h"
#include "wire.h"

namespace hixl {

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  // Copies every op's remote range into its local range before `deadline`. Returns TIMEOUT
  // when the deadline passed, FAILED on any transport error.
  virtual Status pull(const std::vector<Op>& ops, Deadline deadline) = 0;
  // Makes in-flight and later pulls fail fast (unlink, close, failure). Idempotent.
  virtual void abort() = 0;
};

// Same-host reads with process_vm_readv from `pid`; `pidfd` guards against pid reuse.
std::unique_ptr<Transport> make_cma_transport(int pid, UniqueFd pidfd, ThreadPool& pool,
                                              int threads, MemoryMeter& meter);
// Reads over `conns`, data connections already authenticated to the peer's server.
std::unique_ptr<Transport> make_tcp_transport(std::vector<UniqueFd> conns, ThreadPool& pool,
                                              MemoryMeter& meter);

// Link-time probe: opens a pidfd for `pid` and reads `len` bytes at `addr` of that process,
// expecting `expected`. On success *pidfd holds the peer's pidfd.
Status cma_probe(int pid, uint64_t addr, const uint8_t* expected, size_t len, UniqueFd* pidfd);

}  // namespace hixl
