// Pull planning: validate a request against the local and remote cache geometry, merge
// block pairs into runs, and emit one op per tensor per run.
#pragma once

#include <cstdint>
#include <vector>

#include "cache_table.h"
#include "hixl/engine.h"

namespace hixl {

struct Op {
  uint64_t local;
  uint64_t remote;
  uint64_t len;
};

struct ResolvedRange {
  uint64_t first = 0;
  uint64_t count = 0;
};

// Checks that need only local state, in the contract's order: dst is a blocks cache, ids and
// lengths, tensor ranges. Fills the resolved destination tensor range.
Status check_local(const PullRequest& req, const CacheInfo& dst, ResolvedRange* dst_range);

// Checks against the peer's cache and builds the ops (tensor-major). *runs gets the run count.
Status build_ops(const PullRequest& req, const CacheInfo& dst, const ResolvedRange& dst_range,
                 const CacheInfo& src, std::vector<Op>* ops, uint64_t* runs);

// Splits ops into at most `shares` lists of about equal bytes, cutting ops where needed.
std::vector<std::vector<Op>> split_ops(const std::vector<Op>& ops, size_t shares);
uint64_t total_bytes(const std::vector<Op>& ops);

}  // namespace hixl
