#include "cache_table.h"

#include <algorithm>
#include <mutex>

#include "wire.h"

namespace hixl {
namespace {

constexpr uint32_t kMaxTensorsPerCache = 1 << 16;
constexpr uint32_t kMaxKeysPerCache = 1 << 16;
constexpr uint32_t kMaxCaches = 1 << 16;

std::string cache_name(int64_t id) { return "cache " + std::to_string(id); }

}  // namespace

Status CacheTable::add(const CacheRegistration& reg) {
  if (reg.tensor_addrs.empty()) {
    return Status::Error(status::kParamInvalid, cache_name(reg.cache_id) + ": no tensor addresses");
  }
  if (reg.tensor_addrs.size() > kMaxTensorsPerCache) {
    return Status::Error(status::kParamInvalid, cache_name(reg.cache_id) + ": too many tensors");
  }
  if (reg.num_blocks == 0 || reg.tensor_bytes == 0) {
    return Status::Error(status::kParamInvalid,
                         cache_name(reg.cache_id) + ": tensor_bytes and num_blocks must be > 0");
  }
  if (reg.tensor_bytes % reg.num_blocks != 0) {
    return Status::Error(status::kParamInvalid,
                         cache_name(reg.cache_id) + ": tensor_bytes " +
                             std::to_string(reg.tensor_bytes) + " is not a multiple of " +
                             std::to_string(reg.num_blocks));
  }
  for (uint64_t a : reg.tensor_addrs) {
    if (a == 0 || a + reg.tensor_bytes < a) {
      return Status::Error(status::kParamInvalid,
                           cache_name(reg.cache_id) + ": invalid tensor address " +
                               std::to_string(a));
    }
  }
  if (reg.cache_keys.size() > kMaxKeysPerCache) {
    return Status::Error(status::kParamInvalid, cache_name(reg.cache_id) + ": too many keys");
  }
  std::unique_lock<std::shared_mutex> lock(mu_);
  for (const auto& c : caches_) {
    if (c.id == reg.cache_id) {
      return Status::Error(status::kParamInvalid,
                           cache_name(reg.cache_id) + " is already registered");
    }
  }
  if (caches_.size() >= kMaxCaches) {
    return Status::Error(status::kParamInvalid, "too many registered caches");
  }
  CacheInfo info;
  info.id = reg.cache_id;
  info.addrs = reg.tensor_addrs;
  info.tensor_bytes = reg.tensor_bytes;
  info.num_blocks = reg.num_blocks;
  info.is_blocks = reg.is_blocks;
  info.remote_accessible = reg.remote_accessible;
  info.blocks_model_id = reg.blocks_model_id;
  info.keys = reg.cache_keys;
  caches_.push_back(std::move(info));
  rebuild_regions_locked();
  return Status::Ok();
}

Status CacheTable::remove(int64_t id) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  auto it = std::find_if(caches_.begin(), caches_.end(),
                         [id](const CacheInfo& c) { return c.id == id; });
  if (it == caches_.end()) {
    return Status::Error(status::kKvCacheNotExist, cache_name(id) + " is not registered");
  }
  caches_.erase(it);
  rebuild_regions_locked();
  return Status::Ok();
}

bool CacheTable::find(int64_t id, CacheInfo* out) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  for (const auto& c : caches_) {
    if (c.id == id) {
      *out = c;
      return true;
    }
  }
  return false;
}

const CacheInfo* CacheTable::find_locked(int64_t id) const {
  for (const auto& c : caches_) {
    if (c.id == id) return &c;
  }
  return nullptr;
}

void CacheTable::rebuild_regions_locked() {
  regions_.clear();
  for (const auto& c : caches_) {
    if (!c.remote_accessible) continue;
    for (uint64_t a : c.addrs) regions_.push_back({a, a + c.tensor_bytes});
  }
  std::sort(regions_.begin(), regions_.end(),
            [](const Region& a, const Region& b) { return a.begin < b.begin; });
  prefix_max_.resize(regions_.size());
  uint64_t m = 0;
  for (size_t i = 0; i < regions_.size(); ++i) {
    m = std::max(m, regions_[i].end);
    prefix_max_[i] = m;
  }
}

bool CacheTable::range_allowed_locked(uint64_t addr, uint64_t len) const {
  uint64_t end = addr + len;
  if (end < addr) return false;
  // Regions starting at or before addr; scan back while any of them can still reach `end`.
  auto it = std::upper_bound(regions_.begin(), regions_.end(), addr,
                             [](uint64_t a, const Region& r) { return a < r.begin; });
  for (size_t i = static_cast<size_t>(it - regions_.begin()); i > 0; --i) {
    if (prefix_max_[i - 1] < end) return false;
    if (regions_[i - 1].end >= end) return true;
  }
  return false;
}

std::vector<uint8_t> CacheTable::encode_remote_visible() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  wire::Encoder enc;
  uint32_t n = 0;
  for (const auto& c : caches_) n += c.remote_accessible ? 1 : 0;
  enc.u32(n);
  for (const auto& c : caches_) {
    if (!c.remote_accessible) continue;
    enc.i64(c.id);
    enc.u8(c.is_blocks ? 1 : 0);
    enc.u64(c.tensor_bytes);
    enc.u64(c.num_blocks);
    enc.i64(c.blocks_model_id);
    enc.u32(static_cast<uint32_t>(c.keys.size()));
    for (const auto& k : c.keys) {
      enc.i64(k.req_id);
      enc.i64(k.prefix_id);
      enc.i64(k.model_id);
    }
    enc.u32(static_cast<uint32_t>(c.addrs.size()));
    for (uint64_t a : c.addrs) enc.u64(a);
  }
  return std::move(enc.bytes());
}

bool RemoteTable::decode(const uint8_t* data, size_t len, RemoteTable* out, std::string* error) {
  wire::Decoder dec(data, len);
  uint32_t n = 0;
  auto fail = [error](const std::string& why) {
    *error = "malformed cache table: " + why;
    return false;
  };
  if (!dec.u32(&n) || n > kMaxCaches) return fail("cache count");
  out->caches_.clear();
  for (uint32_t i = 0; i < n; ++i) {
    CacheInfo c;
    uint8_t is_blocks = 0;
    uint32_t nkeys = 0, ntensors = 0;
    if (!dec.i64(&c.id) || !dec.u8(&is_blocks) || !dec.u64(&c.tensor_bytes) ||
        !dec.u64(&c.num_blocks) || !dec.i64(&c.blocks_model_id) || !dec.u32(&nkeys) ||
        nkeys > kMaxKeysPerCache) {
      return fail("cache header");
    }
    if (c.num_blocks == 0 || c.tensor_bytes % c.num_blocks != 0) return fail("cache geometry");
    c.is_blocks = is_blocks != 0;
    c.keys.resize(nkeys);
    for (auto& k : c.keys) {
      if (!dec.i64(&k.req_id) || !dec.i64(&k.prefix_id) || !dec.i64(&k.model_id)) {
        return fail("cache key");
      }
    }
    if (!dec.u32(&ntensors) || ntensors > kMaxTensorsPerCache) return fail("tensor count");
    c.addrs.resize(ntensors);
    for (auto& a : c.addrs) {
      if (!dec.u64(&a) || a + c.tensor_bytes < a) return fail("tensor address");
    }
    out->caches_.push_back(std::move(c));
  }
  if (dec.remaining() != 0) return fail("trailing bytes");
  return true;
}

const CacheInfo* RemoteTable::by_id(int64_t id) const {
  for (const auto& c : caches_) {
    if (c.id == id) return &c;
  }
  return nullptr;
}

const CacheInfo* RemoteTable::by_blocks_model(int64_t model_id) const {
  // Last registration wins, as with BlocksCacheKey re-pointing in LLM-DataDist.
  for (auto it = caches_.rbegin(); it != caches_.rend(); ++it) {
    if (it->is_blocks && it->blocks_model_id == model_id) return &*it;
  }
  return nullptr;
}

const CacheInfo* RemoteTable::by_key(int64_t req_id, int64_t prefix_id, int64_t model_id) const {
  for (auto it = caches_.rbegin(); it != caches_.rend(); ++it) {
    for (const auto& k : it->keys) {
      if (k.req_id == req_id && k.prefix_id == prefix_id && k.model_id == model_id) return &*it;
    }
  }
  return nullptr;
}

}  // namespace hixl
