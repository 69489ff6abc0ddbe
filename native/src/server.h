// The serving side: a listener with an accept thread and one thread per connection.
#pragma once

#include <atomic>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "cache_table.h"
#include "handshake.h"
#include "stats.h"
#include "wire.h"

namespace hixl {

class Server {
 public:
  // Connections still in the handshake and authenticated ones are capped separately, so
  // hosts without the token can never take the slots of real links.
  static constexpr int kMaxHandshaking = 16;
  static constexpr int kMaxConnections = 64;  // authenticated
  // A single READ reply may hold its connection (and its source cache's pin) at most this
  // long, however slowly the reader keeps draining it.
  static constexpr int kReadReplyLimitMs = 10 * 60 * 1000;

  // Binds exactly host:port; throws std::runtime_error naming host:port and errno text.
  Server(const std::string& host, int port, Identity identity, std::string token,
         CacheTable& table, EngineStats& stats, MemoryMeter& meter);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const { return port_; }
  void stop();  // idempotent; joins every thread

 private:
  struct Connection {
    UniqueFd fd;
    std::thread thread;
    std::atomic<bool> done{false};
  };

  void accept_loop();
  void reap_finished_locked();
  void serve(Connection* conn);
  // The handshake and then the requests; *authenticated tells which pool the slot is in.
  void serve_connection(int fd, bool* authenticated);
  // Moves a connection that just proved the token to the authenticated count; false when
  // that count is at its limit.
  bool admit_authenticated();
  void serve_requests(int fd);
  // Returns false when the connection must be closed.
  bool handle_read(int fd, const std::vector<uint8_t>& payload);
  void send_error(int fd, int64_t code, const std::string& msg);

  const Identity identity_;
  const std::string token_;
  CacheTable& table_;
  EngineStats& stats_;
  MemoryMeter& meter_;
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;      // eventfd that ends the accept loop
  UniqueFd finished_fd_;  // eventfd a connection thread signals as it ends: reap it now
  int port_ = -1;
  std::thread accept_thread_;
  std::mutex mu_;
  std::list<std::unique_ptr<Connection>> connections_;
  int handshaking_ = 0;    // guarded by mu_
  int authenticated_ = 0;  // guarded by mu_
  bool stopped_ = false;
};

}  // namespace hixl
