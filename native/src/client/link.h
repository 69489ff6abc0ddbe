// One link to a peer: its control connection, its copy of the peer's cache table, the
// chosen transport and state.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include "common/cache_table.h"
#include "common/handshake.h"
#include "transports/transport.h"

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
  // The peer's registrations as of link time, less those it has since unregistered (as
  // far as checked); pulls plan from one copy from start to end.
  std::shared_ptr<const RemoteTable> table() const;
  // Fetches the peer's table and drops from the copy what it no longer holds, unless another
  // pull already replaced `checked` with a copy that counts at least `seen` unregistrations.
  // A failure marks the link broken: the control connection may be mid-frame.
  Status drop_unregistered(const RemoteTable* checked, uint64_t seen, Deadline deadline);
  // Replaces the copy with the peer's whole current table, caches registered since the link
  // included. A failure marks the link broken.
  Status refresh_table(Deadline deadline);
  Transport& transport() { return *transport_; }
  const char* transport_name() const { return transport_->name(); }

  // Transfer accounting: begin() refuses when the link is closing or broken.
  Status begin_transfer();
  void end_transfer();
  void mark_broken(const std::string& reason);
  // Fails in-flight transfers fast, waits for them (bounded); false when they did not finish.
  bool close_and_drain(Deadline deadline);
  // Tells the peer where it may link back to us (return_paths.h); a failure marks the link
  // broken.
  Status offer_return_path(const std::string& host, int port, Deadline deadline);
  // This end's address on the control connection: where the peer reached us from.
  std::string local_host() const { return wire::socket_host(control_.fd.get(), false); }
  // BYE on the control connection so the server drops our connections; "" on success.
  std::string say_goodbye(Deadline deadline);

 private:
  Link() = default;

  int64_t cluster_ = 0;
  ControlChannel control_;  // declared before transport_, which may use it
  std::shared_ptr<const RemoteTable> table_;  // guarded by mu_
  std::unique_ptr<Transport> transport_;
  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  int active_transfers_ = 0;
  bool closing_ = false;
  bool broken_ = false;
  std::string broken_reason_;
};

}  // namespace hixl
