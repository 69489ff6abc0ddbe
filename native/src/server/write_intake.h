// The destination's half of a WRITE (a push): the request is checked against the local table
// under a pin of the destination registration (and, for a cache written by grant, against
// the grant the WRITE names, which must be the writer's), and bytes land only in the ranges
// that passed, while the pin keeps the registration (and so its memory) in place and the
// grant stays unrevoked.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "common/cache_table.h"
#include "common/stats.h"
#include "transports/transport.h"
#include "common/wire.h"
#include "server/write_grants.h"

namespace hixl {

// A same-host writer on one connection, once its probe proved which process it is: writes
// from it are copied in from that process's memory.
struct ProvenWriter {
  int64_t pid = 0;
  UniqueFd pidfd;
};

class WriteIntake {
 public:
  enum class Outcome {
    kRefused,     // *refusal says why; nothing was written and the stream is in step
    kStale,       // the destination registration is gone: the writer refetches our table
    kAwaitData,   // pinned and checked: answer WRITE_READY, then receive the DATA frame
    kDone,        // a same-host write, already copied in
  };

  // Decodes and checks one WRITE of cluster `writer_cluster`; a same-host write is copied
  // in over `copiers`. A kAwaitData intake is left in *out.
  static Outcome start(const std::vector<uint8_t>& payload, const CacheTable& table,
                       WriteGrants& grants, int64_t writer_cluster, ProvenWriter* writer,
                       const Copiers& copiers, MemoryMeter& meter,
                       std::unique_ptr<WriteIntake>* out, Status* refusal, uint64_t* bytes);

  // Whether `h` is the DATA frame this write waits for.
  bool expects(const wire::Header& h) const;
  // Reads what the socket holds into the destination: 1 when every byte landed, 0 when the
  // socket has nothing more now, -1 when the connection failed or closed.
  int receive(int fd);
  uint64_t bytes() const { return total_; }

 private:
  WriteIntake(CacheTable::Pin pin, WriteGrants::Hold hold, std::vector<iovec> iov, uint64_t total,
              MemoryMeter& meter);

  CacheTable::Pin pin_;
  WriteGrants::Hold hold_;
  std::vector<iovec> iov_;
  size_t first_ = 0;
  uint64_t total_ = 0;
  MemoryCharge charge_;
};

}  // namespace hixl
