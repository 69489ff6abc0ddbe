#include "common/cache_table.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <mutex>

#include "common/wire.h"

namespace hixl {
namespace {

constexpr uint32_t kMaxTensorsPerCache = 1 << 16;
constexpr uint32_t kMaxKeysPerCache = 1 << 16;
constexpr uint32_t kMaxCaches = 1 << 16;

std::string cache_name(int64_t id) { return "cache " + std::to_string(id); }

// Whether every page of [addr, addr+len) is mapped in this process: msync asks the kernel to
// walk the range and fails with ENOMEM at the first hole (MS_ASYNC: nothing is written).
// Catches an address that is not this process's memory (an accelerator's, a freed one)
// when it is registered rather than when a peer's transfer faults on it.
bool mapped(uint64_t addr, uint64_t len) {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t start = addr & ~(page - 1);
  return ::msync(reinterpret_cast<void*>(start), addr + len - start, MS_ASYNC) == 0 ||
         errno != ENOMEM;
}

}  // namespace

struct CacheTable::Entry {
  CacheInfo info;
  std::vector<uint64_t> sorted_addrs;  // for range checks
  int pins = 0;
  bool removing = false;
};

CacheTable::Pin::Pin(const CacheTable* table, std::shared_ptr<Entry> entry)
    : table_(table), entry_(std::move(entry)) {}

CacheTable::Pin::~Pin() {
  if (entry_) table_->unpin(*entry_);
}

const CacheInfo& CacheTable::Pin::info() const { return entry_->info; }

bool CacheTable::Pin::contains(uint64_t addr, uint64_t len) const {
  const std::vector<uint64_t>& starts = entry_->sorted_addrs;
  uint64_t end = addr + len;
  if (end < addr) return false;
  // Tensors are equally long, so the last one starting at or before addr reaches furthest.
  auto it = std::upper_bound(starts.begin(), starts.end(), addr);
  return it != starts.begin() && end <= *(it - 1) + entry_->info.tensor_bytes;
}

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
  if (reg.writes_by_grant && (!reg.is_blocks || !reg.remote_accessible)) {
    return Status::Error(status::kParamInvalid,
                         cache_name(reg.cache_id) +
                             ": only a remote-accessible blocks cache is written by grant");
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
    if (!mapped(a, reg.tensor_bytes)) {
      return Status::Error(status::kParamInvalid,
                           cache_name(reg.cache_id) + ": tensor [" + std::to_string(a) + ", +" +
                               std::to_string(reg.tensor_bytes) +
                               ") is not mapped memory of this process");
    }
  }
  if (reg.cache_keys.size() > kMaxKeysPerCache) {
    return Status::Error(status::kParamInvalid, cache_name(reg.cache_id) + ": too many keys");
  }
  auto entry = std::make_shared<Entry>();
  entry->info = CacheInfo{reg};  // the serial is given under the lock, below
  entry->sorted_addrs = reg.tensor_addrs;
  std::sort(entry->sorted_addrs.begin(), entry->sorted_addrs.end());
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& e : entries_) {
    if (e->info.cache_id == reg.cache_id) {
      return Status::Error(status::kParamInvalid,
                           cache_name(reg.cache_id) + " is already registered");
    }
  }
  if (entries_.size() >= kMaxCaches) {
    return Status::Error(status::kParamInvalid, "too many registered caches");
  }
  entry->info.serial = next_serial_++;
  entries_.push_back(std::move(entry));
  return Status::Ok();
}

Status CacheTable::remove(int64_t id) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = std::find_if(entries_.begin(), entries_.end(),
                         [id](const std::shared_ptr<Entry>& e) { return e->info.cache_id == id; });
  if (it == entries_.end()) {
    return Status::Error(status::kKvCacheNotExist, cache_name(id) + " is not registered");
  }
  std::shared_ptr<Entry> entry = *it;
  entries_.erase(it);
  entry->removing = true;
  // Counted before unregister_cache returns, and the owner frees memory only after that: a
  // same-host reader that sees one count before and after its read read registered memory.
  unregistrations_.fetch_add(1);
  unpinned_.wait(lock, [&] { return entry->pins == 0; });
  return Status::Ok();
}

CacheTable::Pin CacheTable::pin_by_id(int64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& e : entries_) {
    if (e->info.cache_id == id) {
      ++e->pins;
      return Pin(this, e);
    }
  }
  return Pin();
}

CacheTable::Pin CacheTable::pin_remote_by_serial(uint64_t serial) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& e : entries_) {
    if (e->info.serial == serial && e->info.remote_accessible) {
      ++e->pins;
      return Pin(this, e);
    }
  }
  return Pin();
}

void CacheTable::unpin(Entry& entry) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (--entry.pins == 0 && entry.removing) unpinned_.notify_all();
}

std::vector<uint8_t> CacheTable::encode_remote_visible() const {
  std::lock_guard<std::mutex> lock(mu_);
  wire::Encoder enc;
  enc.u64(unregistrations_.load());
  uint32_t n = 0;
  for (const auto& e : entries_) n += e->info.remote_accessible ? 1 : 0;
  enc.u32(n);
  for (const auto& e : entries_) {
    const CacheInfo& c = e->info;
    if (!c.remote_accessible) continue;
    enc.i64(c.cache_id);
    enc.u64(c.serial);
    enc.u8(c.is_blocks ? 1 : 0);
    enc.u64(c.tensor_bytes);
    enc.u64(c.num_blocks);
    enc.i64(c.blocks_model_id);
    enc.u32(static_cast<uint32_t>(c.cache_keys.size()));
    for (const auto& k : c.cache_keys) {
      enc.i64(k.req_id);
      enc.i64(k.prefix_id);
      enc.i64(k.model_id);
    }
    enc.u32(static_cast<uint32_t>(c.tensor_addrs.size()));
    for (uint64_t a : c.tensor_addrs) enc.u64(a);
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
  if (!dec.u64(&out->unregistrations_)) return fail("unregistration count");
  if (!dec.u32(&n) || n > kMaxCaches) return fail("cache count");
  out->caches_.clear();
  for (uint32_t i = 0; i < n; ++i) {
    CacheInfo c;
    uint8_t is_blocks = 0;
    uint32_t nkeys = 0, ntensors = 0;
    if (!dec.i64(&c.cache_id) || !dec.u64(&c.serial) || !dec.u8(&is_blocks) ||
        !dec.u64(&c.tensor_bytes) || !dec.u64(&c.num_blocks) ||
        !dec.i64(&c.blocks_model_id) || !dec.u32(&nkeys) ||
        nkeys > kMaxKeysPerCache) {
      return fail("cache header");
    }
    if (c.num_blocks == 0 || c.tensor_bytes % c.num_blocks != 0) return fail("cache geometry");
    c.is_blocks = is_blocks != 0;
    c.cache_keys.resize(nkeys);
    for (auto& k : c.cache_keys) {
      if (!dec.i64(&k.req_id) || !dec.i64(&k.prefix_id) || !dec.i64(&k.model_id)) {
        return fail("cache key");
      }
    }
    if (!dec.u32(&ntensors) || ntensors > kMaxTensorsPerCache) return fail("tensor count");
    c.tensor_addrs.resize(ntensors);
    for (auto& a : c.tensor_addrs) {
      if (!dec.u64(&a) || a + c.tensor_bytes < a) return fail("tensor address");
    }
    out->caches_.push_back(std::move(c));
  }
  if (dec.remaining() != 0) return fail("trailing bytes");
  return true;
}

bool RemoteTable::has_serial(uint64_t serial) const {
  for (const auto& c : caches_) {
    if (c.serial == serial) return true;
  }
  return false;
}

RemoteTable RemoteTable::without_unregistered(const RemoteTable& current) const {
  RemoteTable kept;
  kept.unregistrations_ = current.unregistrations_;
  for (const auto& c : caches_) {
    if (current.has_serial(c.serial)) kept.caches_.push_back(c);
  }
  return kept;
}

const CacheInfo* RemoteTable::by_id(int64_t id) const {
  for (const auto& c : caches_) {
    if (c.cache_id == id) return &c;
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
    for (const auto& k : it->cache_keys) {
      if (k.req_id == req_id && k.prefix_id == prefix_id && k.model_id == model_id) return &*it;
    }
  }
  return nullptr;
}

}  // namespace hixl
