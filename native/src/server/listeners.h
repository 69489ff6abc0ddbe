// The engine's servers: the listener peers link to (moved or closed by switch_role) and, for
// an engine without one, the return listeners its links offer their peers (return_paths.h).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "hixl/engine.h"
#include "server/server.h"

namespace hixl {

class Listeners {
 public:
  // Builds a server on host:port with that many serving threads (0: the engine's option);
  // throws std::runtime_error when it cannot bind.
  using StartServer = std::function<std::unique_ptr<Server>(const std::string&, int, int)>;

  explicit Listeners(StartServer start) : start_(std::move(start)) {}
  ~Listeners() { stop_all(); }
  Listeners(const Listeners&) = delete;
  Listeners& operator=(const Listeners&) = delete;

  Status listen(const std::string& host, int port, int* bound);
  // Closes the listener and every connection it serves; return listeners stay.
  void stop_listening();
  int port() const;  // -1 while not listening
  // Where a peer this engine linked to from `local_host` may link back: the listener ("" for
  // a wildcard address: the peer's view of ours), else a return listener on `local_host`, one
  // serving thread, started on first need.
  Status way_back(const std::string& local_host, std::string* host, int* port);
  void stop_return_listeners();
  void stop_all();

 private:
  const StartServer start_;
  mutable std::mutex mu_;
  std::unique_ptr<Server> server_;
  std::string host_;
  std::map<std::string, std::unique_ptr<Server>> returns_;  // by local address
};

}  // namespace hixl
