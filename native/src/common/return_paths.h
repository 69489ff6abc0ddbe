// Links go both ways, as LLM-DataDist's do: an engine that links to a peer tells the peer's
// server where to reach it back (its listener, or a return listener it opens for the
// purpose), and the peer pulls or pushes over a link of its own to that address, opened on
// first use. An offer lasts as long as the control connection that made it.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>

namespace hixl {

struct ReturnPath {
  std::string host;
  int port = 0;
  uint64_t id = 0;  // which offer: a later one from the same cluster replaces it
};

class ReturnPaths {
 public:
  // Records `cluster`'s offer and returns its id (never 0).
  uint64_t offer(int64_t cluster, const std::string& host, int port);
  // Forgets the offer when it is still offer `id` (its control connection closed).
  void withdraw(int64_t cluster, uint64_t id);
  std::optional<ReturnPath> find(int64_t cluster) const;
  // Whether offer `id` of `cluster` still stands.
  bool stands(int64_t cluster, uint64_t id) const;

 private:
  mutable std::mutex mu_;
  uint64_t last_id_ = 0;
  std::map<int64_t, ReturnPath> paths_;
};

}  // namespace hixl
