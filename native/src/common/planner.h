// Pull planning: validate a request against the local and remote cache geometry, merge
// block pairs into runs, and emit one op per tensor per run.
#pragma once

#include <cstdint>
#include <vector>

#include "common/cache_table.h"
#include "hixl/engine.h"

namespace hixl {

struct Op {
  uint64_t local;
  uint64_t remote;
  uint64_t len;
};

// Consecutive block pairs merged: src_start..+length lands on dst_start..+length.
struct BlockRun {
  uint64_t src_start;
  uint64_t dst_start;
  uint64_t length;
};
std::vector<BlockRun> plan_runs(const int64_t* src, const int64_t* dst, size_t count);

struct ResolvedRange {
  uint64_t first = 0;
  uint64_t count = 0;
};

// A push is planned as the pull it mirrors (as_planned): its local source in the request's
// dst_* fields, the peer's destination in its src_* fields. The direction only names the
// lists and caches in messages as the caller passed them.
enum class Direction { kPull, kPush };
PullRequest as_planned(const PushRequest& push);

// Checks that need only local state, in the contract's order: the local cache is a blocks
// cache, ids and lengths, tensor ranges. Fills the resolved local tensor range.
Status check_local(const PullRequest& req, const CacheInfo& local, ResolvedRange* local_range,
                   Direction direction = Direction::kPull);

// Checks against the peer's cache and builds the ops (tensor-major): each op's local range is
// in `local`, its remote range in `remote`. *runs gets the run count.
Status build_ops(const PullRequest& req, const CacheInfo& local, const ResolvedRange& local_range,
                 const CacheInfo& remote, std::vector<Op>* ops, uint64_t* runs,
                 Direction direction = Direction::kPull);

// Splits ops into at most `shares` lists of about equal bytes, cutting ops where needed.
std::vector<std::vector<Op>> split_ops(const std::vector<Op>& ops, size_t shares);
uint64_t total_bytes(const std::vector<Op>& ops);

// A position in an op list: the op's index and a byte offset inside it.
struct OpCursor {
  size_t op = 0;
  uint64_t offset = 0;
};

// Cuts ops, without copying them, into at most `chunks` byte ranges of about equal size:
// returns the boundaries, chunk i being [cuts[i], cuts[i+1]).
std::vector<OpCursor> cut_ops(const std::vector<Op>& ops, size_t chunks);

// How many chunks `threads` threads claiming them dynamically should get: about 16 each, so
// a thread that loses its core to another process delays the pull by one small chunk only,
// but no chunk under 1 MiB (a claim and its system call would cost more than they save).
size_t chunk_count(uint64_t total_bytes, int threads);

// Calls fn(local, remote, len) for every piece of op memory in [begin, end) until fn returns
// false; returns false iff fn did.
template <class Fn>
bool for_each_piece(const std::vector<Op>& ops, OpCursor begin, OpCursor end, Fn&& fn) {
  for (size_t i = begin.op; i < ops.size() && i <= end.op; ++i) {
    uint64_t from = i == begin.op ? begin.offset : 0;
    uint64_t to = i == end.op ? end.offset : ops[i].len;
    if (to > from && !fn(ops[i].local + from, ops[i].remote + from, to - from)) return false;
  }
  return true;
}

}  // namespace hixl
