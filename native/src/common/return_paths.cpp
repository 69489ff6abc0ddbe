#include "common/return_paths.h"

namespace hixl {

uint64_t ReturnPaths::offer(int64_t cluster, const std::string& host, int port) {
  std::lock_guard<std::mutex> lock(mu_);
  paths_[cluster] = ReturnPath{host, port, ++last_id_};
  return last_id_;
}

void ReturnPaths::withdraw(int64_t cluster, uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = paths_.find(cluster);
  if (it != paths_.end() && it->second.id == id) paths_.erase(it);
}

std::optional<ReturnPath> ReturnPaths::find(int64_t cluster) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = paths_.find(cluster);
  if (it == paths_.end()) return std::nullopt;
  return it->second;
}

bool ReturnPaths::stands(int64_t cluster, uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = paths_.find(cluster);
  return it != paths_.end() && it->second.id == id;
}

}  // namespace hixl
