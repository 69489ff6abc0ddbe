#include "server/write_grants.h"

#include <algorithm>
#include <cstdio>
#include <random>

namespace hixl {
namespace {

// Ids stay in [1, kLastId]: an int64 in Python, never 0.
constexpr uint64_t kLastId = (uint64_t(1) << 63) - 1;

// [1, 2^62]: random, with 2^62 ids of headroom below kLastId.
uint64_t random_first_id() {
  std::random_device entropy;
  const uint64_t bits = (uint64_t(entropy()) << 32) ^ uint64_t(entropy());
  return (bits & ((uint64_t(1) << 62) - 1)) + 1;
}

std::string grant_name(uint64_t id) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%llx", static_cast<unsigned long long>(id));
  return text;
}

}  // namespace

WriteGrants::WriteGrants() : first_id_(random_first_id()), next_id_(first_id_) {}

WriteGrants::Hold& WriteGrants::Hold::operator=(Hold&& other) noexcept {
  if (this != &other) {
    release();
    grants_ = other.grants_;
    id_ = other.id_;
    other.grants_ = nullptr;
  }
  return *this;
}

void WriteGrants::Hold::release() {
  if (grants_ != nullptr) grants_->end_write(id_);
  grants_ = nullptr;
  id_ = 0;
}

Status WriteGrants::grant(int64_t writer, const CacheInfo& cache,
                          const std::vector<int64_t>& blocks, uint64_t* id) {
  if (!cache.is_blocks || !cache.writes_by_grant) {
    return Status::Error(status::kParamInvalid, "cache " + std::to_string(cache.cache_id) +
                                                    " is not a blocks cache written by grant");
  }
  if (blocks.empty()) return Status::Error(status::kParamInvalid, "a grant needs blocks");
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t b : blocks) {
    if (b < 0 || static_cast<uint64_t>(b) >= cache.num_blocks) {
      return Status::Error(status::kParamInvalid,
                           "block " + std::to_string(b) + " is outside cache " +
                               std::to_string(cache.cache_id) + "'s " +
                               std::to_string(cache.num_blocks) + " blocks");
    }
    if (owner_.count({cache.cache_id, b}) != 0) {
      return Status::Error(status::kParamInvalid,
                           "block " + std::to_string(b) + " of cache " +
                               std::to_string(cache.cache_id) + " is already granted");
    }
  }
  Grant g;
  g.writer = writer;
  g.cache_id = cache.cache_id;
  g.blocks = blocks;
  std::sort(g.blocks.begin(), g.blocks.end());
  if (std::adjacent_find(g.blocks.begin(), g.blocks.end()) != g.blocks.end()) {
    return Status::Error(status::kParamInvalid, "a grant names a block twice");
  }
  if (next_id_ > kLastId) {  // 2^62 grants after a random start: unreachable in practice
    return Status::Error(status::kFailed, "this engine has issued every write grant id");
  }
  *id = next_id_++;
  for (int64_t b : g.blocks) owner_[{cache.cache_id, b}] = *id;
  grants_[*id] = std::move(g);
  return Status::Ok();
}

void WriteGrants::withdraw(std::map<uint64_t, Grant>::iterator it) {
  Grant& g = it->second;
  if (!g.revoked) {
    for (int64_t b : g.blocks) owner_.erase({g.cache_id, b});
    g.revoked = true;
  }
  if (g.in_flight == 0) grants_.erase(it);
}

Status WriteGrants::revoke(uint64_t id, Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = grants_.find(id);
  if (it == grants_.end()) {
    // Issued, then revoked and its writes ended (or its cache unregistered): nothing to wait for.
    if (id >= first_id_ && id < next_id_) return Status::Ok();
    return Status::Error(status::kParamInvalid, "no write grant " + grant_name(id));
  }
  withdraw(it);
  const bool idle = idle_.wait_until(lock, deadline, [&] { return grants_.count(id) == 0; });
  if (!idle) {
    return Status::Error(status::kTimeout,
                         "writes under grant " + grant_name(id) + " are still in flight");
  }
  return Status::Ok();
}

bool WriteGrants::admit(int64_t writer, uint64_t grant, const CacheInfo& cache,
                        const std::vector<Op>& ops, Hold* hold, std::string* why) {
  hold->release();  // before the lock: a release takes it
  const uint64_t stride = cache.stride();
  std::lock_guard<std::mutex> lock(mu_);
  // A block passes when owner_ (which maps only grants not revoked) names `grant` for it and
  // `grant` is the writer's: the writer's other grants, even of the same blocks before a
  // revoke, do not count.
  auto named = grants_.find(grant);
  const bool usable = named != grants_.end() && named->second.writer == writer &&
                      !named->second.revoked;
  for (const Op& op : ops) {
    if (op.len == 0) continue;
    auto tensor = std::find_if(cache.tensor_addrs.begin(), cache.tensor_addrs.end(),
                               [&](uint64_t a) { return op.local >= a && op.local - a < cache.tensor_bytes; });
    if (tensor == cache.tensor_addrs.end()) {
      *why = "a write range lies outside cache " + std::to_string(cache.cache_id);
      return false;
    }
    const uint64_t first = (op.local - *tensor) / stride;
    const uint64_t last = (op.local - *tensor + op.len - 1) / stride;
    for (uint64_t b = first; b <= last; ++b) {
      auto owner = owner_.find({cache.cache_id, static_cast<int64_t>(b)});
      if (!usable || owner == owner_.end() || owner->second != grant) {
        *why = "block " + std::to_string(b) + " of cache " + std::to_string(cache.cache_id) +
               " is not under grant " + grant_name(grant) + " of cluster " +
               std::to_string(writer);
        return false;
      }
    }
  }
  if (!usable) return true;  // no byte to write (every range empty): nothing to hold
  named->second.in_flight++;
  hold->grants_ = this;
  hold->id_ = grant;
  return true;
}

void WriteGrants::end_write(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = grants_.find(id);
  if (it != grants_.end() && --it->second.in_flight == 0 && it->second.revoked) {
    grants_.erase(it);
  }
  idle_.notify_all();
}

void WriteGrants::forget_cache(int64_t cache_id) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = grants_.begin(); it != grants_.end();) {
    auto next = std::next(it);
    if (it->second.cache_id == cache_id) withdraw(it);
    it = next;
  }
}

size_t WriteGrants::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return grants_.size();
}

}  // namespace hixl
