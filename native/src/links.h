// The engine's links, by remote cluster id: opened one at a time per cluster, looked up by
// pulls, closed one by one or all at once.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "link.h"
#include "stats.h"

namespace hixl {

std::string cluster_name(int64_t id);

class LinkSet {
 public:
  // `base` carries this engine's side of every link (cluster id, token, transport...).
  LinkSet(const LinkOptions& base, const Identity& me, ThreadPool& pool, MemoryMeter& meter,
          EngineStats& stats)
      : base_(base), me_(me), pool_(pool), meter_(meter), stats_(stats) {}

  Status open(int64_t remote, const std::string& host, int port, int64_t timeout_ms);
  Status close(int64_t remote, int64_t timeout_ms, bool force);
  std::shared_ptr<Link> find(int64_t remote) const;
  // Links open now.
  int64_t size() const;
  // Refuses new links and closes every link (each drain bounded).
  void close_all();

 private:
  const LinkOptions base_;
  const Identity& me_;
  ThreadPool& pool_;
  MemoryMeter& meter_;
  EngineStats& stats_;
  mutable std::mutex mu_;
  bool closed_ = false;
  std::map<int64_t, std::shared_ptr<Link>> links_;
  std::set<int64_t> linking_;
};

}  // namespace hixl
