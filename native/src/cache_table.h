// Registered caches: the local table (with the region index the server checks ranges
// against) and the peer's table as received at link time.
#pragma once

#include <cstdint>
#include <shared_mutex>
#include <string>
#include <vector>

#include "hixl/engine.h"

namespace hixl {

struct CacheInfo {
  int64_t id = 0;
  std::vector<uint64_t> addrs;
  uint64_t tensor_bytes = 0;
  uint64_t num_blocks = 0;  // batch size for contiguous caches
  bool is_blocks = true;
  bool remote_accessible = true;
  int64_t blocks_model_id = -1;
  std::vector<CacheKey> keys;

  uint64_t stride() const { return num_blocks == 0 ? 0 : tensor_bytes / num_blocks; }
};

class RemoteTable {
 public:
  static bool decode(const uint8_t* data, size_t len, RemoteTable* out, std::string* error);
  const CacheInfo* by_id(int64_t id) const;
  const CacheInfo* by_blocks_model(int64_t model_id) const;
  const CacheInfo* by_key(int64_t req_id, int64_t prefix_id, int64_t model_id) const;
  size_t size() const { return caches_.size(); }

 private:
  std::vector<CacheInfo> caches_;
};

class CacheTable {
 public:
  Status add(const CacheRegistration& reg);
  Status remove(int64_t id);
  // Copies the entry so the caller needs no lock to read it.
  bool find(int64_t id, CacheInfo* out) const;
  // Caller holds read_lock(); the pointer is valid while it does.
  const CacheInfo* find_locked(int64_t id) const;
  std::vector<uint8_t> encode_remote_visible() const;

  // Readers (pulls writing into local caches, the server sending from them) hold this so
  // unregister_cache cannot free the memory under them.
  std::shared_lock<std::shared_mutex> read_lock() const {
    return std::shared_lock<std::shared_mutex>(mu_);
  }
  // Caller holds read_lock(). True iff [addr, addr+len) lies inside one remote-accessible
  // tensor.
  bool range_allowed_locked(uint64_t addr, uint64_t len) const;

 private:
  struct Region {
    uint64_t begin;
    uint64_t end;
  };
  void rebuild_regions_locked();

  mutable std::shared_mutex mu_;
  std::vector<CacheInfo> caches_;
  std::vector<Region> regions_;       // sorted by begin
  std::vector<uint64_t> prefix_max_;  // max end over regions_[0..i]
};

}  // namespace hixl
