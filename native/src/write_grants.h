// Write grants: a blocks cache registered with `writes_by_grant` takes a peer's WRITE only
// into blocks its owner granted to that peer's cluster, for as long as the grant stands. A
// block belongs to at most one grant at a time (one request's blocks, one writer), and
// revoke() returns only once no write under the grant is in flight, so a block its owner
// takes back is never written afterwards, whatever the writer does.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cache_table.h"
#include "hixl/engine.h"
#include "planner.h"
#include "wire.h"

namespace hixl {

class WriteGrants {
 public:
  // Keeps the grants a write was admitted under from being revoked until it ends.
  class Hold {
   public:
    Hold() = default;
    ~Hold() { release(); }
    Hold(Hold&& other) noexcept : grants_(other.grants_), ids_(std::move(other.ids_)) {
      other.grants_ = nullptr;
    }
    Hold& operator=(Hold&& other) noexcept;
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    friend class WriteGrants;
    void release();
    WriteGrants* grants_ = nullptr;
    std::vector<uint64_t> ids_;
  };

  // Grants `blocks` of `cache` (a writes_by_grant blocks cache) to `writer`; PARAM_INVALID
  // when a block is out of range or already granted.
  Status grant(int64_t writer, const CacheInfo& cache, const std::vector<int64_t>& blocks,
               uint64_t* id);
  // Withdraws grant `id` at once and waits for writes under it; TIMEOUT when some are still
  // in flight at `deadline` (the grant stays withdrawn: call again to wait for them). A grant
  // already revoked is Ok; an id never issued is PARAM_INVALID.
  Status revoke(uint64_t id, Deadline deadline);
  // Admits a write of `writer` into `cache` when every byte of `ops` (local ranges) lies in a
  // block granted to it; otherwise false and *why.
  bool admit(int64_t writer, const CacheInfo& cache, const std::vector<Op>& ops, Hold* hold,
             std::string* why);
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
  void end_writes(const std::vector<uint64_t>& ids);

  mutable std::mutex mu_;
  std::condition_variable idle_;
  uint64_t last_id_ = 0;
  std::map<uint64_t, Grant> grants_;
  std::map<std::pair<int64_t, int64_t>, uint64_t> owner_;  // (cache id, block) -> grant
};

}  // namespace hixl
