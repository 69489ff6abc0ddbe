// The serving side: a listener whose accept thread hands each connection to one of a fixed
// set of event loops (serve_loop.h). Threads do not grow with links; each cap counts what it
// protects and is an engine option.
#pragma once

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/cache_table.h"
#include "common/handshake.h"
#include "server/admissions.h"
#include "server/serve_loop.h"
#include "common/stats.h"
#include "common/wire.h"

namespace hixl {

struct ServerLimits {
  // Connections in the handshake at once (what hosts without the token can ever hold) and
  // authenticated ones (a link holds one control and tcp_connections data connections).
  int max_handshaking = 1024;
  int max_connections = 4096;
  int threads = 0;  // event loops; 0: one per core, at most kMaxDefaultThreads
  static constexpr int kMaxDefaultThreads = 8;
};

class Server {
 public:
  // Binds exactly host:port; throws std::runtime_error naming host:port and errno text.
  // `engine` holds what the engine shares with its servers (identity, token, table, stats,
  // meter, return paths, grants); the server adds its admissions.
  Server(const std::string& host, int port, const ServeContext& engine,
         const ServerLimits& limits);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const { return port_; }
  int threads() const { return static_cast<int>(loops_.size()); }
  void stop();  // idempotent; joins every thread

 private:
  void accept_loop();
  ServeLoop& least_loaded();

  Admissions admissions_;
  ServeContext context_;
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;  // eventfd that ends the accept loop
  int port_ = -1;
  std::vector<std::unique_ptr<ServeLoop>> loops_;
  std::thread accept_thread_;
  bool stopped_ = false;
};

}  // namespace hixl
