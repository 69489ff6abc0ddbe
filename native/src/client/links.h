// The engine's links, by remote cluster id: opened one at a time per cluster, looked up by
// transfers, closed one by one or all at once. Besides the links this engine opened, a link
// back to a peer that linked to it, opened on first use from the peer's offer
// (return_paths.h) and dropped once that offer is withdrawn.
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "client/link.h"
#include "common/return_paths.h"
#include "common/stats.h"

namespace hixl {

std::string cluster_name(int64_t id);

class LinkSet {
 public:
  // `base` carries this engine's side of every link (cluster id, token, transport...).
  LinkSet(const LinkOptions& base, const Identity& me, ThreadPool& pool, MemoryMeter& meter,
          EngineStats& stats, const ReturnPaths& returns)
      : base_(base), me_(me), pool_(pool), meter_(meter), stats_(stats), returns_(returns) {}

  // Opens a link of this engine's own (replacing a link back to the same peer).
  Status open(int64_t remote, const std::string& host, int port, int64_t timeout_ms);
  // The link a transfer to `remote` goes over: this engine's own, or the link back to a peer
  // that linked here, opened now when it is not open yet (transfers that need it meanwhile
  // wait for that opening, until their deadline); NOT_YET_LINK when there is neither.
  Status reach(int64_t remote, Deadline deadline, std::shared_ptr<Link>* out);
  Status close(int64_t remote, int64_t timeout_ms, bool force);
  std::shared_ptr<Link> find(int64_t remote) const;
  // Links open now, less links back whose offer was withdrawn.
  int64_t size() const;
  // Refuses new links and closes every link (each drain bounded).
  void close_all();

 private:
  const LinkOptions base_;
  const Identity& me_;
  ThreadPool& pool_;
  MemoryMeter& meter_;
  EngineStats& stats_;
  const ReturnPaths& returns_;
  mutable std::mutex mu_;
  bool closed_ = false;
  std::map<int64_t, std::shared_ptr<Link>> links_;
  std::set<int64_t> linking_;
  std::condition_variable linked_;  // a link in `linking_` was opened, or failed to
  std::map<int64_t, uint64_t> links_back_;  // remote -> the offer its link back was opened on

  // Takes the link back to `remote` out of the set (only when its offer was withdrawn, if
  // `only_withdrawn`) and fails its transfers fast; mu_ held. The caller drops it after
  // unlocking.
  std::shared_ptr<Link> take_link_back(int64_t remote, bool only_withdrawn);
};

}  // namespace hixl
