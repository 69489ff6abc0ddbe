// One link to a peer: its control connection, cache table, chosen transport and state.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include "cache_table.h"
#include "handshake.h"
#include "transport.h"

namespace hixl {

struct LinkOptions {
  int64_t my_cluster = 0;
  int64_t remote_cluster = 0;
  std::string host;
  int port = 0;
  std::string token;
  std::string transport;  // auto | cma | tcp
  int tcp_connections = 2;
  int transfer_threads = 2;
};

class Link {
 public:
  // Connect, authenticate, fetch the table, choose and open the transport. The whole
  // sequence is bounded by `deadline`.
  static Status open(const LinkOptions& options, Deadline deadline, const Identity& me,
                     ThreadPool& pool, MemoryMeter& meter, std::unique_ptr<Link>* out);
  ~Link();

  int64_t cluster() const { return cluster_; }
  const RemoteTable& table() const { return table_; }
  Transport& transport() { return *transport_; }
  const char* transport_name() const { return transport_->name(); }

  // Pull accounting: begin() refuses when the link is closing or broken.
  Status begin_pull();
  void end_pull();
  void mark_broken(const std::string& reason);
  // Fails in-flight pulls fast, waits for them (bounded); false when they did not finish.
  bool close_and_drain(Deadline deadline);
  // BYE on the control connection so the server drops our connections; "" on success.
  std::string say_goodbye(Deadline deadline);

 private:
  Link() = default;

  int64_t cluster_ = 0;
  UniqueFd control_;
  RemoteTable table_;
  std::unique_ptr<Transport> transport_;
  std::mutex mu_;
  std::condition_variable idle_cv_;
  int active_pulls_ = 0;
  bool closing_ = false;
  bool broken_ = false;
  std::string broken_reason_;
};

}  // namespace hixl
