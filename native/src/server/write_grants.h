// Write grants: a blocks cache registered with `writes_by_grant` takes a peer's WRITE only
// into blocks of the grant the WRITE names, granted to that peer's cluster, for as long as the
// grant stands. A block belongs to at most one grant at a time (one request's blocks, one
// writer), and revoke() returns only once no write under the grant is in flight, so a block
// its owner takes back is never written afterwards, whatever the writer does. Because a write
// names its grant, a grant stands for one request, not only one writer: when the owner
// revokes request A's grant and grants the same blocks to the same writer for request B, a
// late write for A (naming A) is refused instead of landing in B's blocks.
//
// Grant ids: the first is random (62 random bits, plus 1: in [1, 2^62], so every id fits an
// int64 and stays > 0 for more grants than an engine can issue), then each grant takes the
// next. So an engine that restarted does not reissue an id a writer may still hold from its
// previous life, and 0 never names a grant (a write naming 0 names none).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/cache_table.h"
#include "hixl/engine.h"
#include "common/planner.h"
#include "common/wire.h"

namespace hixl {

class WriteGrants {
 public:
  // Keeps the grant a write was admitted under from being revoked until the write ends.
  class Hold {
   public:
    Hold() = default;
    ~Hold() { release(); }
    Hold(Hold&& other) noexcept : grants_(other.grants_), id_(other.id_) {
      other.grants_ = nullptr;
    }
    Hold& operator=(Hold&& other) noexcept;
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    friend class WriteGrants;
    void release();
    WriteGrants* grants_ = nullptr;
    uint64_t id_ = 0;
  };

  WriteGrants();  // draws the first id (std::random_device; throws when it has no entropy)

  // Grants `blocks` of `cache` (a writes_by_grant blocks cache) to `writer`; PARAM_INVALID
  // when a block is out of range or already granted.
  Status grant(int64_t writer, const CacheInfo& cache, const std::vector<int64_t>& blocks,
               uint64_t* id);
  // Withdraws grant `id` at once and waits for writes under it; TIMEOUT when some are still
  // in flight at `deadline` (the grant stays withdrawn: call again to wait for them). A grant
  // already revoked is Ok; an id never issued is PARAM_INVALID.
  Status revoke(uint64_t id, Deadline deadline);
  // Admits a write of `writer` under `grant` into `cache` when every byte of `ops` (local
  // ranges) lies in a block of that grant, which is `writer`'s and not revoked; otherwise
  // false and *why (naming the block, the cache and the grant).
  bool admit(int64_t writer, uint64_t grant, const CacheInfo& cache, const std::vector<Op>& ops,
             Hold* hold, std::string* why);
  // Drops the grants of an unregistered cache (a later cache may reuse its id).
  void forget_cache(int64_t cache_id);
  size_t size() const;

 private:
  struct Grant {
    int64_t writer = 0;
    int64_t cache_id = 0;
    std::vector<int64_t> blocks;
    int in_flight = 0;
    bool revoked = false;
  };

  void withdraw(std::map<uint64_t, Grant>::iterator it);  // mu_ held
  void end_write(uint64_t id);

  mutable std::mutex mu_;
  std::condition_variable idle_;
  const uint64_t first_id_;  // ids issued so far: [first_id_, next_id_)
  uint64_t next_id_;
  std::map<uint64_t, Grant> grants_;
  // (cache id, block) -> its grant; only grants not revoked own blocks.
  std::map<std::pair<int64_t, int64_t>, uint64_t> owner_;
};

}  // namespace hixl
