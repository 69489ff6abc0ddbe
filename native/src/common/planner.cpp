#include "common/planner.h"

#include <algorithm>
#include <string>

namespace hixl {
namespace {

Status invalid(const std::string& msg) { return Status::Error(status::kParamInvalid, msg); }

std::string list_entry(const char* name, size_t i, int64_t v) {
  return std::string(name) + "[" + std::to_string(i) + "]=" + std::to_string(v);
}

// The batch row a contiguous source is read from. A CacheKey selects its own row: a cache
// registered under keys k0, k1, ... holds key i in batch row i (LLM-DataDist semantics).
Status source_row(const PullRequest& req, const CacheInfo& src, uint64_t* row) {
  const std::string sname = "remote cache " + std::to_string(src.cache_id);
  const std::string batch = " with batch size " + std::to_string(src.num_blocks);
  if (req.remote_kind == kCacheById) {
    if (req.batch_index < 0 || static_cast<uint64_t>(req.batch_index) >= src.num_blocks) {
      return invalid("batch_index " + std::to_string(req.batch_index) + " is outside " + sname +
                     batch);
    }
    *row = static_cast<uint64_t>(req.batch_index);
    return Status::Ok();
  }
  if (req.batch_index != 0) {
    return invalid("batch_index " + std::to_string(req.batch_index) +
                   " must be 0 for a CacheKey: the key selects the row of " + sname);
  }
  const std::string key = "key (req_id=" + std::to_string(req.req_id) + ", prefix_id=" +
                          std::to_string(req.prefix_id) + ", model_id=" +
                          std::to_string(req.model_id) + ")";
  for (size_t i = 0; i < src.cache_keys.size(); ++i) {
    const CacheKey& k = src.cache_keys[i];
    if (k.req_id != req.req_id || k.prefix_id != req.prefix_id || k.model_id != req.model_id) {
      continue;
    }
    if (i >= src.num_blocks) {
      return invalid(key + " is key " + std::to_string(i) + " of " + sname + batch +
                     ": it has no batch row");
    }
    *row = i;
    return Status::Ok();
  }
  return invalid(key + " is not a key of " + sname);
}

// How the caller named what the planner calls local and remote.
struct Names {
  std::string local_cache;
  const char* local_blocks;
  const char* remote_blocks;
  const char* local_tensors;
  const char* remote_tensors;
};

Names names(Direction direction, const CacheInfo& local) {
  const std::string id = std::to_string(local.cache_id);
  if (direction == Direction::kPush) {
    return {"src cache " + id, "src_blocks", "dst_blocks", "src", "dst"};
  }
  return {"dst cache " + id, "dst_blocks", "src_blocks", "dst", "src"};
}

// The tensor-count mismatch as the caller sees it: a pull's source is remote, a push's local.
Status count_mismatch(Direction direction, uint64_t remote, uint64_t local) {
  const bool pull = direction == Direction::kPull;
  return invalid("src tensor count " + std::to_string(pull ? remote : local) +
                 " != dst tensor count " + std::to_string(pull ? local : remote));
}

// A transfer between blocks: local block ids in dst_blocks, the peer's in src_blocks.
Status check_local_blocks(const PullRequest& req, const CacheInfo& local, const Names& name) {
  const std::string& dname = name.local_cache;
  if (!local.is_blocks) return invalid(dname + " is not a blocks cache");
  if (req.dst_blocks.empty()) return invalid(std::string(name.local_blocks) + " is empty");
  if (req.remote_kind == kBlocksByModel) {
    if (req.src_blocks.empty()) {
      return invalid(std::string(name.remote_blocks) + " is empty for a blocks cache key");
    }
    if (req.src_blocks.size() != req.dst_blocks.size()) {
      return invalid("len(" + std::string(name.remote_blocks) + ")=" +
                     std::to_string(req.src_blocks.size()) + " != len(" + name.local_blocks +
                     ")=" + std::to_string(req.dst_blocks.size()));
    }
    for (size_t i = 0; i < req.src_blocks.size(); ++i) {
      if (req.src_blocks[i] < 0) {
        return invalid(list_entry(name.remote_blocks, i, req.src_blocks[i]));
      }
    }
  } else if (!req.src_blocks.empty()) {
    return invalid("src_blocks must be empty unless the source is a blocks cache key");
  }
  for (size_t i = 0; i < req.dst_blocks.size(); ++i) {
    int64_t b = req.dst_blocks[i];
    if (b < 0 || static_cast<uint64_t>(b) >= local.num_blocks) {
      return invalid(list_entry(name.local_blocks, i, b) + " is outside " + dname + " with " +
                     std::to_string(local.num_blocks) + " blocks");
    }
  }
  return Status::Ok();
}

// A transfer of one row of a contiguous local cache (pull_cache, push_cache).
Status check_local_row(const PullRequest& req, const CacheInfo& local, const Names& name) {
  const std::string& dname = name.local_cache;
  if (local.is_blocks) return invalid(dname + " is a blocks cache: name its blocks");
  if (!req.dst_blocks.empty() || !req.src_blocks.empty()) {
    return invalid("a row of a contiguous cache takes no block lists");
  }
  if (req.remote_kind == kBlocksByModel) {
    return invalid("a row moves between contiguous caches: name the peer's cache by id or key");
  }
  if (static_cast<uint64_t>(req.dst_batch_index) >= local.num_blocks) {
    return invalid("batch_index " + std::to_string(req.dst_batch_index) + " is outside " + dname +
                   " with batch size " + std::to_string(local.num_blocks));
  }
  const bool too_long = req.size > 0 && static_cast<uint64_t>(req.size) > local.stride();
  if (req.size == 0 || req.size < -1 || too_long) {
    return invalid("size " + std::to_string(req.size) + " does not fit a " +
                   std::to_string(local.stride()) + "-byte row of " + dname);
  }
  return Status::Ok();
}

}  // namespace

PullRequest as_planned(const PushRequest& push) {
  PullRequest r;
  r.remote_cluster_id = push.remote_cluster_id;
  r.remote_kind = push.remote_kind;
  r.model_id = push.model_id;
  r.cache_id = push.cache_id;
  r.batch_index = push.batch_index;
  r.dst_batch_index = push.src_batch_index;
  r.dst_cache_id = push.src_cache_id;
  r.src_blocks = push.dst_blocks;
  r.dst_blocks = push.src_blocks;
  r.src_tensor_first = push.dst_tensor_first;
  r.src_tensor_count = push.dst_tensor_count;
  r.dst_tensor_first = push.src_tensor_first;
  r.dst_tensor_count = push.src_tensor_count;
  r.timeout_ms = push.timeout_ms;
  return r;
}

std::vector<BlockRun> plan_runs(const int64_t* src, const int64_t* dst, size_t count) {
  std::vector<BlockRun> runs;
  for (size_t i = 0; i < count; ++i) {
    if (!runs.empty()) {
      BlockRun& last = runs.back();
      if (static_cast<uint64_t>(src[i]) == last.src_start + last.length &&
          static_cast<uint64_t>(dst[i]) == last.dst_start + last.length) {
        ++last.length;
        continue;
      }
    }
    runs.push_back({static_cast<uint64_t>(src[i]), static_cast<uint64_t>(dst[i]), 1});
  }
  return runs;
}

Status check_local(const PullRequest& req, const CacheInfo& local, ResolvedRange* local_range,
                   Direction direction) {
  const Names name = names(direction, local);
  const std::string& dname = name.local_cache;
  Status s = req.dst_batch_index >= 0 ? check_local_row(req, local, name)
                                      : check_local_blocks(req, local, name);
  if (!s.ok()) return s;
  const std::string lt = name.local_tensors, rt = name.remote_tensors;
  const uint64_t n = local.tensor_addrs.size();
  if (req.dst_tensor_first < 0 || static_cast<uint64_t>(req.dst_tensor_first) >= n) {
    return invalid(lt + " tensor first " + std::to_string(req.dst_tensor_first) + " outside " +
                   dname + " with " + std::to_string(n) + " tensors");
  }
  uint64_t count = req.dst_tensor_count == -1 ? n - req.dst_tensor_first
                                              : static_cast<uint64_t>(req.dst_tensor_count);
  if (req.dst_tensor_count == 0 || req.dst_tensor_count < -1 ||
      req.dst_tensor_first + count > n) {
    return invalid(lt + " tensor range [" + std::to_string(req.dst_tensor_first) + ", +" +
                   std::to_string(req.dst_tensor_count) + ") outside " + dname + " with " +
                   std::to_string(n) + " tensors");
  }
  if (req.src_tensor_first < 0 || req.src_tensor_count == 0 || req.src_tensor_count < -1) {
    return invalid(rt + " tensor range [" + std::to_string(req.src_tensor_first) + ", +" +
                   std::to_string(req.src_tensor_count) + ") is invalid");
  }
  if (req.src_tensor_count != -1 && static_cast<uint64_t>(req.src_tensor_count) != count) {
    return count_mismatch(direction, static_cast<uint64_t>(req.src_tensor_count), count);
  }
  local_range->first = static_cast<uint64_t>(req.dst_tensor_first);
  local_range->count = count;
  return Status::Ok();
}

namespace {

// One op per tensor: the local row dst_batch_index and the peer's row (its key's or
// batch_index), `size` bytes or the whole local row, which must fit the peer's row.
Status row_ops(const PullRequest& req, const CacheInfo& local, const ResolvedRange& local_range,
               const CacheInfo& remote, uint64_t remote_first, std::vector<Op>* ops,
               uint64_t* run_count) {
  const std::string rname = "remote cache " + std::to_string(remote.cache_id);
  if (remote.is_blocks) return invalid(rname + " is a blocks cache: name its blocks");
  uint64_t row = 0;
  Status s = source_row(req, remote, &row);
  if (!s.ok()) return s;
  const uint64_t len = req.size > 0 ? static_cast<uint64_t>(req.size) : local.stride();
  if (len > remote.stride()) {
    return invalid(std::to_string(len) + " bytes do not fit the " +
                   std::to_string(remote.stride()) + "-byte rows of " + rname);
  }
  const uint64_t local_offset = static_cast<uint64_t>(req.dst_batch_index) * local.stride();
  ops->clear();
  for (uint64_t t = 0; t < local_range.count; ++t) {
    ops->push_back({local.tensor_addrs[local_range.first + t] + local_offset,
                    remote.tensor_addrs[remote_first + t] + row * remote.stride(), len});
  }
  *run_count = 1;
  return Status::Ok();
}

}  // namespace

// Named as for a pull: `dst` is the local cache and `src` the remote one, also for a push.
Status build_ops(const PullRequest& req, const CacheInfo& dst, const ResolvedRange& dst_range,
                 const CacheInfo& src, std::vector<Op>* ops, uint64_t* run_count,
                 Direction direction) {
  const Names name = names(direction, dst);
  const std::string sname = "remote cache " + std::to_string(src.cache_id);
  const uint64_t ns = src.tensor_addrs.size();
  const uint64_t src_first = static_cast<uint64_t>(req.src_tensor_first);
  uint64_t src_count = req.src_tensor_count == -1 ? (src_first < ns ? ns - src_first : 0)
                                                  : static_cast<uint64_t>(req.src_tensor_count);
  if (src_first >= ns || src_first + src_count > ns) {
    return invalid(std::string(name.remote_tensors) + " tensor range [" +
                   std::to_string(req.src_tensor_first) + ", +" +
                   std::to_string(req.src_tensor_count) + ") outside " + sname + " with " +
                   std::to_string(ns) + " tensors");
  }
  if (src_count != dst_range.count) return count_mismatch(direction, src_count, dst_range.count);
  if (req.dst_batch_index >= 0) {
    return row_ops(req, dst, dst_range, src, src_first, ops, run_count);
  }
  const uint64_t dst_stride = dst.stride();
  const uint64_t src_stride = src.stride();
  uint64_t src_base = 0;       // byte offset of src "block" 0 inside a remote tensor
  uint64_t src_unit = 0;       // bytes between consecutive src ids
  std::vector<int64_t> slice_ids;
  const std::vector<int64_t>* src_ids = &req.src_blocks;
  if (req.remote_kind == kBlocksByModel) {
    // Block i of the source lands on block j here byte for byte: unequal block sizes would
    // spread one source block over parts of two destination blocks.
    if (src_stride != dst_stride) {
      return invalid(sname + " has blocks of " + std::to_string(src_stride) + " bytes, " +
                     name.local_cache + " blocks of " + std::to_string(dst_stride));
    }
    for (size_t i = 0; i < req.src_blocks.size(); ++i) {
      if (static_cast<uint64_t>(req.src_blocks[i]) >= src.num_blocks) {
        return invalid(list_entry(name.remote_blocks, i, req.src_blocks[i]) + " is outside " +
                       sname +
                       " with " + std::to_string(src.num_blocks) + " blocks");
      }
    }
    src_unit = src_stride;
  } else {
    uint64_t row = 0;
    Status s = source_row(req, src, &row);
    if (!s.ok()) return s;
    uint64_t n = req.dst_blocks.size();
    if (n * dst_stride > src_stride) {
      return invalid(std::to_string(n) + " slices of " + std::to_string(dst_stride) +
                     " bytes exceed the " + std::to_string(src_stride) + "-byte row of " + sname);
    }
    src_base = row * src_stride;
    src_unit = dst_stride;
    slice_ids.resize(n);
    for (uint64_t i = 0; i < n; ++i) slice_ids[i] = static_cast<int64_t>(i);
    src_ids = &slice_ids;
  }
  std::vector<BlockRun> runs = plan_runs(src_ids->data(), req.dst_blocks.data(), src_ids->size());
  for (const auto& r : runs) {
    uint64_t len = r.length * dst_stride;
    uint64_t src_off = src_base + r.src_start * src_unit;
    if (src_off + len > src.tensor_bytes) {
      return invalid("run of " + std::to_string(r.length) + " blocks from src block " +
                     std::to_string(r.src_start) + " (" + std::to_string(len) +
                     " bytes) does not fit " + sname + " tensors of " +
                     std::to_string(src.tensor_bytes) + " bytes");
    }
  }
  ops->clear();
  ops->reserve(runs.size() * dst_range.count);
  for (uint64_t t = 0; t < dst_range.count; ++t) {
    uint64_t local_base = dst.tensor_addrs[dst_range.first + t];
    uint64_t remote_base = src.tensor_addrs[src_first + t];
    for (const auto& r : runs) {
      ops->push_back({local_base + r.dst_start * dst_stride,
                      remote_base + src_base + r.src_start * src_unit, r.length * dst_stride});
    }
  }
  *run_count = runs.size();
  return Status::Ok();
}

uint64_t total_bytes(const std::vector<Op>& ops) {
  uint64_t total = 0;
  for (const auto& op : ops) total += op.len;
  return total;
}

std::vector<OpCursor> cut_ops(const std::vector<Op>& ops, size_t chunks) {
  const uint64_t total = total_bytes(ops);
  chunks = std::max<size_t>(1, chunks);
  const uint64_t target = (total + chunks - 1) / chunks;
  std::vector<OpCursor> cuts;
  cuts.reserve(chunks + 1);
  cuts.push_back({0, 0});
  uint64_t next = target;
  uint64_t pos = 0;
  for (size_t i = 0; i < ops.size() && target > 0; ++i) {
    const uint64_t end = pos + ops[i].len;
    while (next < end && cuts.size() < chunks) {
      cuts.push_back({i, next - pos});
      next += target;
    }
    pos = end;
  }
  cuts.push_back({ops.size(), 0});
  return cuts;
}

size_t chunk_count(uint64_t total_bytes, int threads) {
  constexpr uint64_t kMinChunkBytes = 1u << 20;
  constexpr uint64_t kChunksPerThread = 16;
  if (threads <= 1) return 1;
  uint64_t most = static_cast<uint64_t>(threads) * kChunksPerThread;
  return static_cast<size_t>(std::max<uint64_t>(1, std::min(most, total_bytes / kMinChunkBytes)));
}

std::vector<std::vector<Op>> split_ops(const std::vector<Op>& ops, size_t shares) {
  std::vector<std::vector<Op>> out;
  uint64_t total = total_bytes(ops);
  if (shares <= 1 || total == 0) {
    out.push_back(ops);
    return out;
  }
  uint64_t target = (total + shares - 1) / shares;
  out.emplace_back();
  uint64_t filled = 0;
  for (Op op : ops) {
    while (op.len > 0) {
      if (filled == target && out.size() < shares) {
        out.emplace_back();
        filled = 0;
      }
      uint64_t take = out.size() < shares ? std::min(op.len, target - filled) : op.len;
      out.back().push_back({op.local, op.remote, take});
      op.local += take;
      op.remote += take;
      op.len -= take;
      filled += take;
    }
  }
  return out;
}

}  // namespace hixl
