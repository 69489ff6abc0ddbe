// Registered caches: the local table (whose registrations transfers pin) and a peer's table
// as fetched at link time.
//
// Every registration gets a serial no other registration shares, and the table counts its
// unregistrations, so a peer holding a copy can tell that the copy may name memory that is
// no longer registered (the count moved) and whether the cache it read from stayed
// registered (its serial is still there).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "hixl/engine.h"

namespace hixl {

// A registration as the table (and a peer's copy of it) holds it: what the caller registered
// plus the serial the table gave it.
struct CacheInfo : CacheRegistration {
  uint64_t serial = 0;

  uint64_t stride() const { return num_blocks == 0 ? 0 : tensor_bytes / num_blocks; }
};

class RemoteTable {
 public:
  static bool decode(const uint8_t* data, size_t len, RemoteTable* out, std::string* error);
  const CacheInfo* by_id(int64_t id) const;
  const CacheInfo* by_blocks_model(int64_t model_id) const;
  const CacheInfo* by_key(int64_t req_id, int64_t prefix_id, int64_t model_id) const;
  bool has_serial(uint64_t serial) const;
  size_t size() const { return caches_.size(); }
  uint64_t unregistrations() const { return unregistrations_; }
  // This copy without the registrations `current` (a newer copy) no longer holds, and with
  // its unregistration count. Caches registered since are left out: as with LLM-DataDist,
  // memory registered after the link is not remotely accessible.
  RemoteTable without_unregistered(const RemoteTable& current) const;

 private:
  uint64_t unregistrations_ = 0;
  std::vector<CacheInfo> caches_;
};

class CacheTable {
 public:
  struct Entry;

  // Keeps one registration's memory registered for one transfer: unregister_cache waits
  // until every pin of the cache is released. Pins of other caches do not hold it up.
  class Pin {
   public:
    Pin() = default;
    Pin(const CacheTable* table, std::shared_ptr<Entry> entry);
    ~Pin();
    Pin(Pin&& other) noexcept = default;
    Pin& operator=(Pin&&) = delete;
    Pin(const Pin&) = delete;
    Pin& operator=(const Pin&) = delete;

    explicit operator bool() const { return entry_ != nullptr; }
    const CacheInfo& info() const;
    // True iff [addr, addr+len) lies inside one of this cache's tensors.
    bool contains(uint64_t addr, uint64_t len) const;

   private:
    const CacheTable* table_ = nullptr;
    std::shared_ptr<Entry> entry_;
  };

  Status add(const CacheRegistration& reg);
  // New pins of the cache fail at once; returns when the last transfer using it finished
  // (each is bounded by its own deadline or stall timeout).
  Status remove(int64_t id);
  Pin pin_by_id(int64_t id) const;
  // Only remote-accessible registrations: what a peer may read.
  Pin pin_remote_by_serial(uint64_t serial) const;
  std::vector<uint8_t> encode_remote_visible() const;

  // Same-host peers read the unregistration count straight from this address, so it must
  // stay put for the table's lifetime (the table is neither copied nor moved).
  const std::atomic<uint64_t>* unregistrations_address() const { return &unregistrations_; }

 private:
  void unpin(Entry& entry) const;

  mutable std::mutex mu_;
  mutable std::condition_variable unpinned_;
  uint64_t next_serial_ = 1;
  std::atomic<uint64_t> unregistrations_{0};
  std::vector<std::shared_ptr<Entry>> entries_;
};

}  // namespace hixl
