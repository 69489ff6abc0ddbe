// One event-loop thread serving many engine connections over non-blocking sockets: the
// handshake, then READ, WRITE, TABLE and BYE requests. Each connection is a state machine, so a
// server's threads do not grow with its links, and a peer that stops reading or writing
// holds only its own connection, never a thread.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/cache_table.h"
#include "common/handshake.h"
#include "server/admissions.h"
#include "server/landed_writes.h"
#include "common/return_paths.h"
#include "server/write_grants.h"
#include "common/stats.h"
#include "common/wire.h"
#include "server/write_intake.h"

namespace hixl {

// What every loop of a server shares (owned by the server).
struct ServeContext {
  Identity identity;
  std::string token;
  CacheTable* table = nullptr;
  EngineStats* stats = nullptr;
  MemoryMeter* meter = nullptr;
  Admissions* admissions = nullptr;
  ReturnPaths* returns = nullptr;  // the engine's: peers' offers to be linked back to
  WriteGrants* grants = nullptr;   // the engine's: which blocks each peer may write
  LandedWrites* landed = nullptr;  // the engine's: told of every write that landed
  Copiers copiers;                 // the engine's transfer threads, for same-host writes
  // The refusal texts, naming each cap and the option that raises it.
  std::string handshakes_full;
  std::string connections_full;
};

class ServeLoop {
 public:
  // A single READ reply, or a WRITE's data, may hold its connection (and its cache's pin) at
  // most this long, however slowly the peer keeps it moving.
  static constexpr int kReadReplyLimitMs = 10 * 60 * 1000;

  explicit ServeLoop(const ServeContext& context);  // throws std::system_error
  ~ServeLoop();
  ServeLoop(const ServeLoop&) = delete;
  ServeLoop& operator=(const ServeLoop&) = delete;

  // Takes an accepted socket that already holds a handshake slot; any thread.
  void adopt(UniqueFd fd);
  int connections() const { return count_.load(); }
  // Closes every connection and joins the thread; idempotent.
  void stop();

 private:
  struct Conn;

  void run();
  void take_inbox();
  void on_event(Conn& c, uint32_t events);
  // Reads and handles frames until the socket is drained or a reply is pending; false when
  // the connection must close.
  bool read_frames(Conn& c);
  bool handle_frame(Conn& c);
  bool handle_handshake(Conn& c);
  bool handle_request(Conn& c);
  bool start_read_reply(Conn& c);
  void take_return_path(Conn& c);
  // Answers a WRITE: refused, stale, copied in (same host) or ready for its DATA frame.
  void start_write(Conn& c);
  void finish_write(Conn& c);
  // Sends what is pending; false when the connection must close.
  bool flush(Conn& c);
  void queue_frame(Conn& c, uint16_t type, const std::vector<uint8_t>& payload);
  // Sends an ERROR frame and closes once it is out (or could not be sent).
  void fail(Conn& c, int64_t code, const std::string& msg);
  void watch(Conn& c);
  void sweep();
  void close(int fd);

  const ServeContext& ctx_;
  UniqueFd epoll_fd_;
  UniqueFd wake_fd_;
  std::mutex inbox_mu_;
  std::vector<UniqueFd> inbox_;
  bool stopping_ = false;  // guarded by inbox_mu_
  std::unordered_map<int, std::unique_ptr<Conn>> conns_;  // the loop thread's own
  std::atomic<int> count_{0};
  Clock::time_point last_sweep_;
  std::thread thread_;
};

}  // namespace hixl
