#include "server/listeners.h"

#include <exception>

namespace hixl {
namespace {

bool is_wildcard(const std::string& host) {
  return host.empty() || host == "0.0.0.0" || host == "::";
}

}  // namespace

Status Listeners::listen(const std::string& host, int port, int* bound) {
  if (host.empty() || port < 0 || port > 65535) {
    return Status::Error(status::kParamInvalid,
                         "listen on '" + host + ":" + std::to_string(port) + "': bad address");
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (server_) {
    *bound = server_->port();
    if (port == 0 || port == server_->port()) return Status::Ok();
    return Status::Error(status::kParamInvalid,
                         "already listening on port " + std::to_string(server_->port()));
  }
  try {
    server_ = start_(host, port, 0);
  } catch (const std::exception& e) {
    return Status::Error(status::kLinkFailed, e.what());
  }
  host_ = host;
  *bound = server_->port();
  return Status::Ok();
}

void Listeners::stop_listening() {
  std::unique_ptr<Server> stopped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped = std::move(server_);
  }
  if (stopped) stopped->stop();
}

int Listeners::port() const {
  std::lock_guard<std::mutex> lock(mu_);
  return server_ ? server_->port() : -1;
}

Status Listeners::way_back(const std::string& local_host, std::string* host, int* port) {
  std::lock_guard<std::mutex> lock(mu_);
  if (server_) {
    *host = is_wildcard(host_) ? "" : host_;
    *port = server_->port();
    return Status::Ok();
  }
  std::unique_ptr<Server>& back = returns_[local_host];
  try {
    // One serving thread: it serves the few peers this engine linked to.
    if (!back) back = start_(local_host, 0, 1);
  } catch (const std::exception& e) {
    returns_.erase(local_host);
    return Status::Error(status::kLinkFailed, std::string("return listener: ") + e.what());
  }
  *host = local_host;
  *port = back->port();
  return Status::Ok();
}

void Listeners::stop_return_listeners() {
  std::map<std::string, std::unique_ptr<Server>> stopped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped.swap(returns_);
  }
  for (auto& kv : stopped) kv.second->stop();
}

void Listeners::stop_all() {
  stop_listening();
  stop_return_listeners();
}

}  // namespace hixl
