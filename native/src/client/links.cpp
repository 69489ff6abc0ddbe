// The engine's links by remote cluster id.
#include "client/links.h"

#include <algorithm>

namespace hixl {

std::string cluster_name(int64_t id) { return "cluster " + std::to_string(id); }

Status LinkSet::open(int64_t remote, const std::string& host, int port, int64_t timeout_ms) {
  if (timeout_ms <= 0 || port <= 0 || port > 65535 || host.empty()) {
    return Status::Error(status::kParamInvalid, "link to " + cluster_name(remote) +
                                                    ": bad host/port/timeout " + host + ":" +
                                                    std::to_string(port));
  }
  std::shared_ptr<Link> replaced;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return Status::Error(status::kEngineFinalized, "engine is closed");
    replaced = take_link_back(remote, false);
    if (links_.count(remote) != 0 || linking_.count(remote) != 0) {
      return Status::Error(status::kAlreadyLink, "already linked to " + cluster_name(remote));
    }
    linking_.insert(remote);
  }
  LinkOptions options = base_;
  options.remote_cluster = remote;
  options.host = host;
  options.port = port;
  std::unique_ptr<Link> opened;
  Status s = Link::open(options, deadline_after_ms(timeout_ms), me_, pool_, meter_, &opened);
  std::lock_guard<std::mutex> lock(mu_);
  linking_.erase(remote);
  linked_.notify_all();
  if (s.ok() && closed_) s = Status::Error(status::kEngineFinalized, "engine is closed");
  if (!s.ok()) return s;
  links_[remote] = std::shared_ptr<Link>(std::move(opened));
  stats_.links++;
  return Status::Ok();
}

std::shared_ptr<Link> LinkSet::take_link_back(int64_t remote, bool only_withdrawn) {
  auto back = links_back_.find(remote);
  if (back == links_back_.end()) return nullptr;
  if (only_withdrawn && returns_.stands(remote, back->second)) return nullptr;
  links_back_.erase(back);
  auto it = links_.find(remote);
  std::shared_ptr<Link> taken = std::move(it->second);
  links_.erase(it);
  taken->close_and_drain(Clock::now());  // in-flight transfers fail fast; nobody waits
  return taken;
}

Status LinkSet::reach(int64_t remote, Deadline deadline, std::shared_ptr<Link>* out) {
  std::shared_ptr<Link> withdrawn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    withdrawn = take_link_back(remote, true);
    auto it = links_.find(remote);
    if (it != links_.end()) {
      *out = it->second;
      return Status::Ok();
    }
  }
  std::optional<ReturnPath> path = returns_.find(remote);
  if (!path) return Status::Error(status::kNotYetLink, "not linked to " + cluster_name(remote));
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  Status s = open(remote, path->host, path->port, std::max<int64_t>(left.count(), 1));
  std::unique_lock<std::mutex> lock(mu_);
  if (s.code == status::kAlreadyLink) {
    // Another transfer opens it now: use that one once it is open (or failed to open).
    linked_.wait_until(lock, deadline, [&] { return closed_ || linking_.count(remote) == 0; });
  }
  auto it = links_.find(remote);
  if (s.ok() && it != links_.end()) links_back_[remote] = path->id;
  if (it == links_.end()) {
    if (s.code == status::kAlreadyLink && linking_.count(remote) != 0) {
      return Status::Error(status::kTimeout,
                           "the link back to " + cluster_name(remote) + " was still opening");
    }
    return s.ok() ? Status::Error(status::kNotYetLink, "not linked to " + cluster_name(remote))
                  : s;
  }
  *out = it->second;
  return Status::Ok();
}

Status LinkSet::close(int64_t remote, int64_t timeout_ms, bool force) {
  std::shared_ptr<Link> link;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(remote);
    if (it == links_.end()) {
      // As in LLM-DataDist, a forced unlink only tears down what is here: nothing to tear
      // down is not a failure (the peer may have linked to us, or be gone already).
      if (force) return Status::Ok();
      return Status::Error(status::kNotYetLink, "not linked to " + cluster_name(remote));
    }
    link = std::move(it->second);
    links_.erase(it);
    links_back_.erase(remote);
  }
  const Deadline deadline = deadline_after_ms(std::max<int64_t>(timeout_ms, 1));
  if (!link->close_and_drain(deadline)) {
    return Status::Error(status::kUnlinkFailed, "pulls on the link to " + cluster_name(remote) +
                                                    " did not finish within " +
                                                    std::to_string(timeout_ms) + " ms");
  }
  if (!force) {
    std::string e = link->say_goodbye(deadline);
    if (!e.empty()) {
      return Status::Error(status::kUnlinkFailed,
                           "unlinked locally but could not notify " + cluster_name(remote) +
                               " (" + e + "); use force=True for a dead peer");
    }
  }
  return Status::Ok();
}

std::shared_ptr<Link> LinkSet::find(int64_t remote) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = links_.find(remote);
  return it == links_.end() ? nullptr : it->second;
}

int64_t LinkSet::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t withdrawn = 0;
  for (const auto& back : links_back_) {
    if (!returns_.stands(back.first, back.second)) ++withdrawn;
  }
  return static_cast<int64_t>(links_.size()) - withdrawn;
}

void LinkSet::close_all() {
  std::map<int64_t, std::shared_ptr<Link>> doomed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    linked_.notify_all();
    doomed.swap(links_);
    links_back_.clear();
  }
  for (auto& kv : doomed) kv.second->close_and_drain(deadline_after_ms(5000));
}

}  // namespace hixl
