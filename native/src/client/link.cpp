#include "client/link.h"

namespace hixl {
namespace {

Status fetch_table(int fd, Deadline deadline, RemoteTable* table, const std::string& peer) {
  wire::IoResult io = wire::send_frame(fd, wire::kTableRequest, {}, deadline);
  wire::Header h;
  std::vector<uint8_t> payload;
  if (io.ok()) io = wire::recv_frame(fd, &h, &payload, wire::kMaxTablePayload, deadline);
  if (!io.ok()) {
    return Status::Error(io.timed_out() ? status::kTimeout : status::kLinkFailed,
                         "fetching the cache table of " + peer + ": " + io.reason);
  }
  if (h.type == wire::kError) return wire::decode_error(payload, "cache table of " + peer);
  std::string e;
  if (h.type != wire::kTable || !RemoteTable::decode(payload.data(), payload.size(), table, &e)) {
    return Status::Error(status::kLinkFailed, "cache table of " + peer + ": " +
                                                  (e.empty() ? "unexpected frame" : e));
  }
  return Status::Ok();
}

Status connect_and_greet(const LinkOptions& o, uint8_t channel, Deadline deadline,
                         UniqueFd* fd, Identity* peer) {
  std::string error;
  *fd = wire::connect_to(o.host, o.port, deadline, &error);
  if (!fd->valid()) {
    return Status::Error(Clock::now() >= deadline ? status::kTimeout : status::kLinkFailed,
                         "cluster " + std::to_string(o.remote_cluster) + ": " + error);
  }
  return client_handshake(fd->get(), o.my_cluster, o.remote_cluster, channel, o.token, deadline,
                          peer);
}

}  // namespace

Status Link::open(const LinkOptions& o, Deadline deadline, const Identity& me, ThreadPool& pool,
                  MemoryMeter& meter, std::unique_ptr<Link>* out) {
  const std::string peer = "cluster " + std::to_string(o.remote_cluster);
  std::unique_ptr<Link> link(new Link());
  link->cluster_ = o.remote_cluster;
  Identity peer_id;
  Status s = connect_and_greet(o, wire::kControlChannel, deadline, &link->control_.fd, &peer_id);
  if (!s.ok()) return s;
  auto table = std::make_shared<RemoteTable>();
  s = fetch_table(link->control_.fd.get(), deadline, table.get(), peer);
  if (!s.ok()) return s;
  link->table_ = std::move(table);

  Status cma_refusal;
  if (o.transport != "tcp") {
    UniqueFd pidfd;
    if (peer_id.boot_id != me.boot_id || peer_id.boot_id.empty()) {
      cma_refusal = Status::Error(status::kLinkFailed, peer + " runs on another host");
    } else if (peer_id.pid_namespace != me.pid_namespace) {
      cma_refusal = Status::Error(status::kLinkFailed, peer + " runs in another pid namespace");
    } else {
      cma_refusal = cma_probe(static_cast<int>(peer_id.pid), peer_id.probe_addr,
                              peer_id.probe.data(), peer_id.probe.size(), &pidfd);
    }
    if (cma_refusal.ok()) {
      link->transport_ =
          make_cma_transport(static_cast<int>(peer_id.pid), std::move(pidfd),
                             peer_id.unregistrations_addr, link->control_, me, pool,
                             o.transfer_threads, meter);
    } else if (o.transport == "cma") {
      cma_refusal.message = "cma transport unavailable: " + cma_refusal.message;
      return cma_refusal;
    }
  }
  if (!link->transport_) {
    std::vector<UniqueFd> conns;
    for (int i = 0; i < o.tcp_connections; ++i) {
      UniqueFd fd;
      Identity again;
      s = connect_and_greet(o, wire::kDataChannel, deadline, &fd, &again);
      // A server at its connection cap keeps the link with the data connections it took:
      // connections per link shrink as a server fills up, never below one.
      if (s.code == status::kLinkBusy && !conns.empty()) break;
      if (!s.ok()) return s;
      if (again.pid != peer_id.pid || again.boot_id != peer_id.boot_id) {
        return Status::Error(status::kLinkFailed, peer + " changed process during link");
      }
      conns.push_back(std::move(fd));
    }
    link->transport_ = make_tcp_transport(std::move(conns), pool, meter);
  }
  *out = std::move(link);
  return Status::Ok();
}

Link::~Link() {
  if (transport_) transport_->abort();
}

std::shared_ptr<const RemoteTable> Link::table() const {
  std::lock_guard<std::mutex> lock(mu_);
  return table_;
}

Status Link::drop_unregistered(const RemoteTable* checked, uint64_t seen, Deadline deadline) {
  std::lock_guard<std::mutex> control(control_.mu);
  std::shared_ptr<const RemoteTable> copy = table();
  if (copy.get() != checked && copy->unregistrations() >= seen) return Status::Ok();
  RemoteTable current;
  Status s = fetch_table(control_.fd.get(), deadline, &current, "cluster " + std::to_string(cluster_));
  if (!s.ok()) {
    mark_broken(s.message);
    return s;
  }
  auto kept = std::make_shared<const RemoteTable>(copy->without_unregistered(current));
  std::lock_guard<std::mutex> lock(mu_);
  table_ = std::move(kept);
  return Status::Ok();
}

Status Link::refresh_table(Deadline deadline) {
  std::lock_guard<std::mutex> control(control_.mu);
  auto current = std::make_shared<RemoteTable>();
  Status s = fetch_table(control_.fd.get(), deadline, current.get(),
                         "cluster " + std::to_string(cluster_));
  if (!s.ok()) {
    mark_broken(s.message);
    return s;
  }
  std::lock_guard<std::mutex> lock(mu_);
  table_ = std::move(current);
  return Status::Ok();
}

Status Link::begin_transfer() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closing_) {
    return Status::Error(status::kLinkBusy,
                         "link to cluster " + std::to_string(cluster_) + " is being unlinked");
  }
  if (broken_) {
    return Status::Error(status::kNotYetLink, "link to cluster " + std::to_string(cluster_) +
                                                  " is broken (" + broken_reason_ +
                                                  "): unlink(force=True) and link again");
  }
  ++active_transfers_;
  return Status::Ok();
}

void Link::end_transfer() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--active_transfers_ == 0) idle_cv_.notify_all();
}

void Link::mark_broken(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_ || broken_) return;
    broken_ = true;
    broken_reason_ = reason;
  }
  transport_->abort();
}

bool Link::close_and_drain(Deadline deadline) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
  }
  transport_->abort();
  std::unique_lock<std::mutex> lock(mu_);
  return idle_cv_.wait_until(lock, deadline, [this] { return active_transfers_ == 0; });
}

Status Link::offer_return_path(const std::string& host, int port, Deadline deadline) {
  std::lock_guard<std::mutex> control(control_.mu);
  wire::Encoder offer;
  offer.str(host);
  offer.u32(static_cast<uint32_t>(port));
  wire::IoResult io = wire::send_frame(control_.fd.get(), wire::kReturnPath, offer.bytes(), deadline);
  wire::Header h;
  std::vector<uint8_t> payload;
  if (io.ok()) io = wire::recv_frame(control_.fd.get(), &h, &payload, 1024, deadline);
  const std::string what = "return path to cluster " + std::to_string(cluster_);
  Status s;
  if (!io.ok()) {
    s = Status::Error(io.timed_out() ? status::kTimeout : status::kLinkFailed, what + ": " + io.reason);
  } else if (h.type == wire::kError) {
    s = wire::decode_error(payload, what);
  } else if (h.type != wire::kReturnPathAck) {
    s = Status::Error(status::kLinkFailed, what + ": unexpected reply");
  }
  if (!s.ok()) mark_broken(s.message);
  return s;
}

std::string Link::say_goodbye(Deadline deadline) {
  std::lock_guard<std::mutex> control(control_.mu);
  wire::IoResult io = wire::send_frame(control_.fd.get(), wire::kBye, {}, deadline);
  if (!io.ok()) return io.reason;
  wire::Header h;
  std::vector<uint8_t> payload;
  io = wire::recv_frame(control_.fd.get(), &h, &payload, 1024, deadline);
  if (!io.ok()) return io.reason;
  return h.type == wire::kByeAck ? "" : "unexpected reply to BYE";
}

}  // namespace hixl
