// The facade: owns the cache table, links, server, transfer pool and async pull handles.
#include "hixl/engine.h"

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <system_error>

#include "client/async_pulls.h"
#include "common/auth.h"
#include "common/cache_table.h"
#include "common/handshake.h"
#include "client/links.h"
#include "server/listeners.h"
#include "common/planner.h"
#include "server/server.h"
#include "common/stats.h"
#include "common/thread_pool.h"
#include "server/landed_writes.h"
#include "server/write_grants.h"

namespace hixl {
namespace {

// A link takes one control and tcp_connections data connections of the peer's cap.
constexpr int kMaxTcpConnections = 16;
constexpr int kMaxTransferThreads = 64;
constexpr int kMaxServerConnections = 1 << 20;
constexpr int kMaxServerThreads = 64;
// A same-host batch under this many bytes is copied on the caller's thread (copies_here):
// under ~100 us at a host's memory bandwidth.
constexpr uint64_t kCopyHereBytes = 1u << 20;

void validate(const EngineOptions& o) {
  if (o.transport != "auto" && o.transport != "cma" && o.transport != "tcp") {
    throw std::invalid_argument("transport must be auto, cma or tcp, not '" + o.transport + "'");
  }
  if (o.tcp_connections < 1 || o.tcp_connections > kMaxTcpConnections) {
    throw std::invalid_argument("tcp_connections must be in [1, " +
                                std::to_string(kMaxTcpConnections) + "]");
  }
  if (o.transfer_threads < 1 || o.transfer_threads > kMaxTransferThreads) {
    throw std::invalid_argument("transfer_threads must be in [1, " +
                                std::to_string(kMaxTransferThreads) + "]");
  }
  if (o.server_handshakes < 1 || o.server_handshakes > kMaxServerConnections) {
    throw std::invalid_argument("server_handshakes must be in [1, " +
                                std::to_string(kMaxServerConnections) + "]");
  }
  if (o.server_connections < 1 + kMaxTcpConnections ||
      o.server_connections > kMaxServerConnections) {
    throw std::invalid_argument("server_connections must be in [" +
                                std::to_string(1 + kMaxTcpConnections) + ", " +
                                std::to_string(kMaxServerConnections) + "] (one link must fit)");
  }
  if (o.server_threads < 0 || o.server_threads > kMaxServerThreads) {
    throw std::invalid_argument("server_threads must be in [0, " +
                                std::to_string(kMaxServerThreads) + "] (0: one per core)");
  }
  if (o.listen_port < -1 || o.listen_port > 65535) {
    throw std::invalid_argument("listen_port must be -1 (no listener) or in [0, 65535]");
  }
  if (o.listen_port >= 0 && o.listen_host.empty()) {
    throw std::invalid_argument("listen_host is required when listen_port >= 0");
  }
  std::string token = token_problem(o.auth_token);
  if (!token.empty()) throw std::invalid_argument(token);
}

}  // namespace

class Engine::Impl {
 public:
  explicit Impl(const EngineOptions& o) : opts(o) {
    validate(o);
    // Resources the system may refuse (randomness, threads): a clear error, not a crash.
    try {
      wire::fill_random(probe, sizeof(probe));
      pool = std::make_unique<ThreadPool>(o.transfer_threads);
    } catch (const std::system_error& e) {
      throw std::runtime_error(std::string("cannot start the engine: ") + e.what());
    }
    identity = local_identity(o.cluster_id, probe,
                              reinterpret_cast<uint64_t>(table.unregistrations_address()));
    LinkOptions mine;
    mine.my_cluster = o.cluster_id;
    mine.token = o.auth_token;
    mine.transport = o.transport;
    mine.tcp_connections = o.tcp_connections;
    mine.transfer_threads = o.transfer_threads;
    links = std::make_unique<LinkSet>(mine, identity, *pool, meter, stats, returns);
    listeners = std::make_unique<Listeners>(
        [this](const std::string& host, int port, int threads) {
          return start_server(host, port, threads);
        });
    if (o.listen_port >= 0) {
      int bound = 0;
      Status s = listeners->listen(o.listen_host, o.listen_port, &bound);
      if (!s.ok()) throw std::runtime_error(s.message);
    }
  }

  // Throws std::runtime_error when host:port cannot be bound.
  std::unique_ptr<Server> start_server(const std::string& host, int port, int threads) {
    ServerLimits limits;
    limits.max_handshaking = opts.server_handshakes;
    limits.max_connections = opts.server_connections;
    limits.threads = threads == 0 ? opts.server_threads : threads;
    ServeContext shared;
    shared.identity = identity;
    shared.token = opts.auth_token;
    shared.table = &table;
    shared.stats = &stats;
    shared.meter = &meter;
    shared.returns = &returns;
    shared.grants = &grants;
    shared.landed = &landed;
    shared.copiers = {pool.get(), opts.transfer_threads};
    return std::make_unique<Server>(host, port, shared, limits);
  }

  // Links to `remote` and tells it where to link back (listeners.h).
  Status link(int64_t remote, const std::string& host, int port, int64_t timeout_ms) {
    if (closed.load()) return Status::Error(status::kEngineFinalized, "engine is closed");
    const Deadline deadline = deadline_after_ms(std::max<int64_t>(timeout_ms, 1));
    Status s = links->open(remote, host, port, timeout_ms);
    if (!s.ok()) return s;
    if (!opts.links_both_ways) return s;
    std::shared_ptr<Link> link = links->find(remote);
    if (!link) {
      return Status::Error(status::kNotYetLink, "link to " + cluster_name(remote) + " closed");
    }
    std::string back_host;
    int back_port = 0;
    s = listeners->way_back(link->local_host(), &back_host, &back_port);
    if (s.ok()) s = link->offer_return_path(back_host, back_port, deadline);
    if (!s.ok()) links->close(remote, 1, true);
    return s;
  }

  // Closes the return listeners once no link of ours needs one.
  Status unlink(int64_t remote, int64_t timeout_ms, bool force) {
    Status s = links->close(remote, timeout_ms, force);
    if (links->size() == 0) listeners->stop_return_listeners();
    return s;
  }

  // Runs one transfer and counts it. Only the constructor throws: anything else
  // (std::bad_alloc, say) becomes this transfer's failure, so neither a caller nor a waiter
  // on an async handle is left hanging.
  template <class Run>
  Status counted(std::atomic<int64_t>& transfers, Run&& run) {
    transfers++;
    Status s;
    try {
      s = run();
    } catch (const std::exception& e) {
      s = Status::Error(status::kFailed, std::string("internal error: ") + e.what());
    } catch (...) {
      s = Status::Error(status::kFailed, "internal error");
    }
    if (!s.ok()) {
      stats.failures++;
      if (s.code == status::kTimeout) stats.timeouts++;
    }
    return s;
  }

  Status pull(const PullRequest& r) {
    return counted(stats.pulls, [&] { return run_pull(r); });
  }

  Status run_pull(const PullRequest& r) {
    if (closed.load()) return Status::Error(status::kEngineFinalized, "engine is closed");
    if (r.remote_kind < kBlocksByModel || r.remote_kind > kCacheByKey) {
      return Status::Error(status::kParamInvalid,
                           "remote_kind " + std::to_string(r.remote_kind) + " is not 0, 1 or 2");
    }
    if (r.timeout_ms <= 0) {
      return Status::Error(status::kParamInvalid,
                           "timeout_ms must be > 0, got " + std::to_string(r.timeout_ms));
    }
    const Deadline deadline = deadline_after_ms(r.timeout_ms);
    const CacheTable::Pin dst_pin = table.pin_by_id(r.dst_cache_id);  // registered till the end
    if (!dst_pin) {
      return Status::Error(status::kKvCacheNotExist,
                           "dst cache " + std::to_string(r.dst_cache_id) + " is not registered");
    }
    const CacheInfo* dst = &dst_pin.info();
    ResolvedRange dst_range;
    Status s = check_local(r, *dst, &dst_range);
    if (!s.ok()) return s;
    std::shared_ptr<Link> link;
    s = links->reach(r.remote_cluster_id, deadline, &link);
    if (!s.ok()) return s;
    return on_link(*link, r.remote_cluster_id,
                   [&] { return pull_over(*link, r, *dst, dst_range, deadline); });
  }

  // Runs one transfer on `link`, counted so an unlink waits for it; a timeout or transport
  // failure leaves the link broken (LLM-DataDist: it cannot be recovered).
  template <class Transfer>
  static Status on_link(Link& link, int64_t remote, Transfer&& transfer) {
    Status s = link.begin_transfer();
    if (!s.ok()) return s;
    struct EndTransfer {
      Link& l;
      ~EndTransfer() { l.end_transfer(); }
    } end_transfer{link};
    s = transfer();
    if (!s.ok()) {
      if (s.code == status::kTimeout || s.code == status::kFailed ||
          !link.transport().usable()) {
        link.mark_broken(s.message);
      }
      s.message = cluster_name(remote) + ": " + s.message;
    }
    return s;
  }

  Status push(const PushRequest& r) {
    return counted(stats.pushes, [&] { return run_push(r); });
  }

  Status run_push(const PushRequest& push) {
    if (closed.load()) return Status::Error(status::kEngineFinalized, "engine is closed");
    if (push.timeout_ms <= 0) {
      return Status::Error(status::kParamInvalid,
                           "timeout_ms must be > 0, got " + std::to_string(push.timeout_ms));
    }
    const Deadline deadline = deadline_after_ms(push.timeout_ms);
    const CacheTable::Pin src_pin = table.pin_by_id(push.src_cache_id);
    if (!src_pin) {
      return Status::Error(status::kKvCacheNotExist,
                           "src cache " + std::to_string(push.src_cache_id) + " is not registered");
    }
    const PullRequest planned = as_planned(push);
    ResolvedRange src_range;
    Status s = check_local(planned, src_pin.info(), &src_range, Direction::kPush);
    if (!s.ok()) return s;
    std::shared_ptr<Link> link;
    s = links->reach(push.remote_cluster_id, deadline, &link);
    if (!s.ok()) return s;
    return on_link(*link, push.remote_cluster_id,
                   [&] {
                     return push_over(*link, planned, src_pin.info(), src_range, push.grant,
                                      deadline);
                   });
  }

  // A push: `push` writes from `src` into the peer's cache its table names, under `grant`.
  Status push_over(Link& link, const PullRequest& planned, const CacheInfo& src,
                   const ResolvedRange& src_range, uint64_t grant, Deadline deadline) {
    return replanned(link, planned, src, src_range, Direction::kPush, deadline, stats.pushed_bytes,
                     [&](const std::vector<Op>& ops, const RemoteTable&, const CacheInfo& dst,
                         PeerView*) {
                       return link.transport().push(ops, dst.serial, grant, deadline);
                     });
  }

  // A pull: the peer's cache its table names into `dst`.
  Status pull_over(Link& link, const PullRequest& r, const CacheInfo& dst,
                   const ResolvedRange& dst_range, Deadline deadline) {
    return replanned(link, r, dst, dst_range, Direction::kPull, deadline, stats.bytes,
                     [&](const std::vector<Op>& ops, const RemoteTable& remote,
                         const CacheInfo& src, PeerView* seen) {
                       return link.transport().pull(
                           ops, {remote.unregistrations(), src.serial}, deadline, seen);
                     });
  }

  // Plans from the link's copy of the peer's table and runs `transfer` (a pull or a push).
  // When the peer unregistered caches since the copy was checked, the copy drops what is
  // gone and the transfer is planned again, a bounded number of times. A read that saw the
  // peer's table move but took every byte from a registration that outlived it stands.
  template <class Transfer>
  Status replanned(Link& link, const PullRequest& r, const CacheInfo& local,
                   const ResolvedRange& local_range, Direction direction, Deadline deadline,
                   std::atomic<int64_t>& moved_bytes, Transfer&& transfer) {
    constexpr int kMaxPlans = 4;
    for (int attempt = 1;; ++attempt) {
      std::shared_ptr<const RemoteTable> remote = link.table();
      const CacheInfo* peer = find_remote(*remote, r);
      if (peer == nullptr) return remote_missing(r);
      std::vector<Op> ops;
      uint64_t runs = 0;
      Status s = build_ops(r, local, local_range, *peer, &ops, &runs, direction);
      if (!s.ok()) return s;
      MemoryCharge charge(meter, static_cast<int64_t>(ops.capacity() * sizeof(Op)));
      PeerView seen;
      s = transfer(ops, *remote, *peer, &seen);
      if (s.code == plan::kStale || s.code == plan::kTableMoved) {
        Status checked = link.drop_unregistered(remote.get(), seen.unregistrations, deadline);
        if (!checked.ok()) return checked;
        // `peer` lives in `remote`, which this transfer still holds after the link's copy
        // changed.
        if (s.code == plan::kTableMoved && link.table()->has_serial(peer->serial)) {
          s = Status::Ok();
        } else if (attempt < kMaxPlans) {
          continue;
        } else {
          return Status::Error(status::kKvCacheNotExist,
                               "the peer unregistered caches during each of " +
                                   std::to_string(kMaxPlans) + " attempts");
        }
      }
      if (!s.ok()) return s;
      moved_bytes += static_cast<int64_t>(total_bytes(ops));
      stats.ops += static_cast<int64_t>(ops.size());
      stats.runs += static_cast<int64_t>(runs);
      return Status::Ok();
    }
  }

  static const CacheInfo* find_remote(const RemoteTable& t, const PullRequest& r) {
    switch (r.remote_kind) {
      case kBlocksByModel:
        return t.by_blocks_model(r.model_id);
      case kCacheById:
        return t.by_id(r.cache_id);
      default:
        return t.by_key(r.req_id, r.prefix_id, r.model_id);
    }
  }

  static Status remote_missing(const PullRequest& r) {
    std::string what;
    if (r.remote_kind == kBlocksByModel) {
      what = "no blocks cache with model_id " + std::to_string(r.model_id);
    } else if (r.remote_kind == kCacheById) {
      what = "no remote-accessible cache " + std::to_string(r.cache_id);
    } else {
      what = "no cache with key (req_id=" + std::to_string(r.req_id) +
             ", prefix_id=" + std::to_string(r.prefix_id) +
             ", model_id=" + std::to_string(r.model_id) + ")";
    }
    return Status::Error(status::kKvCacheNotExist,
                         cluster_name(r.remote_cluster_id) + " has " + what);
  }

  // The requests in order, each complete before the next begins; the first failure stops
  // the rest, its message naming its place. A batch may be a guarded read (lease word,
  // blocks, word again: leases/guarded_read.py), so a full fence parts the pulls: no load of
  // one is performed after a load of the next, also where the CPU reorders loads (arm64).
  Status pull_batch(const std::vector<PullRequest>& requests) {
    for (size_t i = 0; i < requests.size(); ++i) {
      if (i > 0) std::atomic_thread_fence(std::memory_order_seq_cst);
      Status s = pull(requests[i]);
      if (!s.ok()) {
        if (requests.size() > 1) {
          s.message = "pull " + std::to_string(i + 1) + " of " +
                      std::to_string(requests.size()) + " in the batch: " + s.message;
        }
        return s;
      }
    }
    return Status::Ok();
  }

  Status submit(std::vector<PullRequest> batch, uint64_t* handle) {
    if (closed.load()) return Status::Error(status::kEngineFinalized, "engine is closed");
    if (copies_here(batch)) {
      stats.caller_batches++;
      return async.run_here([this, &batch] { return pull_batch(batch); }, handle);
    }
    return async.submit(
        *pool, [this, requests = std::move(batch)] { return pull_batch(requests); }, handle);
  }

  // Whether a submitted batch is copied on the caller's thread: when every pull is a
  // same-host read and all of them together land under kCopyHereBytes. Handing such a batch
  // to a pool thread costs more than the copy: the thread must wake and get a core, which
  // beside a busy step thread (a vLLM engine pinned to one core) takes up to milliseconds for
  // tens of microseconds of copying. A tcp pull waits on the peer's serving thread, so it
  // always goes to the pool; so does anything this cannot size (the pull reports it).
  bool copies_here(const std::vector<PullRequest>& batch) const {
    uint64_t bytes = 0;
    for (const PullRequest& r : batch) {
      std::shared_ptr<Link> link = links->find(r.remote_cluster_id);
      if (!link || std::string(link->transport_name()) != "cma") return false;
      const CacheTable::Pin dst = table.pin_by_id(r.dst_cache_id);
      if (!dst) return false;
      const CacheInfo& info = dst.info();
      const auto tensors = static_cast<int64_t>(info.tensor_addrs.size());
      const int64_t count = r.dst_tensor_count < 0 ? tensors - r.dst_tensor_first
                                                   : r.dst_tensor_count;
      if (count < 0 || count > tensors) return false;
      const uint64_t per_tensor =
          info.is_blocks ? info.stride() * r.dst_blocks.size() : info.tensor_bytes;
      bytes += per_tensor * static_cast<uint64_t>(count);
      if (bytes >= kCopyHereBytes) return false;
    }
    return true;
  }

  void close() {
    if (closed.exchange(true)) return;
    listeners->stop_all();
    links->close_all();
    pool->shutdown();  // queued pulls run now and fail fast with ENGINE_FINALIZED
  }

  const EngineOptions opts;
  EngineStats stats;
  MemoryMeter meter;
  CacheTable table;
  uint8_t probe[kProbeBytes] = {};  // the cma probe reads these bytes from our memory
  Identity identity;
  std::unique_ptr<ThreadPool> pool;
  ReturnPaths returns;  // peers that linked here: where to link back to them
  WriteGrants grants;   // which blocks of writes_by_grant caches each peer may write
  LandedWrites landed;  // peers' writes landed here, for a wait on the next one
  std::unique_ptr<Listeners> listeners;
  std::unique_ptr<LinkSet> links;
  std::atomic<bool> closed{false};
  AsyncPulls async;
};

Engine::Engine(const EngineOptions& options) : impl_(std::make_unique<Impl>(options)) {}
Engine::~Engine() { close(); }

int64_t Engine::cluster_id() const { return impl_->opts.cluster_id; }
int Engine::listen_port() const { return impl_->listeners->port(); }

Status Engine::refresh_peer_table(int64_t remote, int64_t timeout_ms) {
  std::shared_ptr<Link> link = impl_->links->find(remote);
  if (!link) return Status::Error(status::kNotYetLink, "not linked to " + cluster_name(remote));
  if (timeout_ms <= 0) return Status::Error(status::kParamInvalid, "timeout_ms must be > 0");
  return link->refresh_table(deadline_after_ms(timeout_ms));
}

Status Engine::listen(const std::string& host, int port, int* bound) {
  if (impl_->closed.load()) return Status::Error(status::kEngineFinalized, "engine is closed");
  return impl_->listeners->listen(host, port, bound);
}

void Engine::stop_listening() { impl_->listeners->stop_listening(); }

Status Engine::register_cache(const CacheRegistration& reg) {
  if (impl_->closed.load()) return Status::Error(status::kEngineFinalized, "engine is closed");
  return impl_->table.add(reg);
}

Status Engine::unregister_cache(int64_t cache_id) {
  if (impl_->closed.load()) return Status::Error(status::kEngineFinalized, "engine is closed");
  Status s = impl_->table.remove(cache_id);
  if (s.ok()) impl_->grants.forget_cache(cache_id);
  return s;
}

Status Engine::grant_writes(int64_t writer, int64_t cache_id, const std::vector<int64_t>& blocks,
                            uint64_t* grant) {
  if (impl_->closed.load()) return Status::Error(status::kEngineFinalized, "engine is closed");
  const CacheTable::Pin cache = impl_->table.pin_by_id(cache_id);
  if (!cache) {
    return Status::Error(status::kKvCacheNotExist,
                         "cache " + std::to_string(cache_id) + " is not registered");
  }
  return impl_->grants.grant(writer, cache.info(), blocks, grant);
}

uint64_t Engine::writes_landed() const { return impl_->landed.count(); }

uint64_t Engine::wait_for_writes(uint64_t seen, int64_t timeout_ms) {
  return impl_->landed.wait_past(seen, timeout_ms);
}

Status Engine::revoke_writes(uint64_t grant, int64_t timeout_ms) {
  if (timeout_ms <= 0) return Status::Error(status::kParamInvalid, "timeout_ms must be > 0");
  return impl_->grants.revoke(grant, deadline_after_ms(timeout_ms));
}

Status Engine::link(int64_t remote, const std::string& host, int port, int64_t timeout_ms) {
  return impl_->link(remote, host, port, timeout_ms);
}

Status Engine::unlink(int64_t remote, int64_t timeout_ms, bool force) {
  return impl_->unlink(remote, timeout_ms, force);
}

std::string Engine::peer_transport(int64_t remote) const {
  std::shared_ptr<Link> link = impl_->links->find(remote);
  return link ? link->transport_name() : "";
}

Status Engine::pull(const PullRequest& request) { return impl_->pull(request); }
Status Engine::push(const PushRequest& request) { return impl_->push(request); }
Status Engine::submit_pull_batch(std::vector<PullRequest> requests, uint64_t* handle) {
  return impl_->submit(std::move(requests), handle);
}
Status Engine::wait(uint64_t handle, int64_t timeout_ms, int64_t* finished_ns) {
  return impl_->async.wait(handle, timeout_ms, finished_ns);
}
Status Engine::poll(uint64_t handle, int64_t* finished_ns) {
  return impl_->async.wait(handle, 0, finished_ns);
}
void Engine::close() { impl_->close(); }

std::map<std::string, int64_t> Engine::stats() const {
  const EngineStats& s = impl_->stats;
  return {{"pulls", s.pulls},
          {"failures", s.failures},
          {"bytes", s.bytes},
          {"ops", s.ops},
          {"runs", s.runs},
          {"timeouts", s.timeouts},
          {"links", s.links},
          {"open_links", impl_->links ? impl_->links->size() : 0},
          {"served_bytes", s.served_bytes},
          {"served_requests", s.served_requests},
          {"rejected_requests", s.rejected_requests},
          {"caller_batches", s.caller_batches},
          {"pushes", s.pushes},
          {"pushed_bytes", s.pushed_bytes},
          {"received_writes", s.received_writes},
          {"received_bytes", s.received_bytes},
          {"peak_internal_bytes", impl_->meter.peak()}};
}

}  // namespace hixl
