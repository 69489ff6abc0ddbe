// Public facade of the native HIXL engine: caches, links, pulls, status codes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace hixl {

// Values match CANN's LLMStatusCode so Python can pass them through unchanged.
namespace status {
constexpr int64_t kSuccess = 0;
constexpr int64_t kPending = 1;  // async only: not finished yet
constexpr int64_t kKvCacheNotExist = 1343270914;
constexpr int64_t kParamInvalid = 1343270917;
constexpr int64_t kEngineFinalized = 1343270918;
constexpr int64_t kNotYetLink = 1343270919;
constexpr int64_t kAlreadyLink = 1343270920;
constexpr int64_t kLinkFailed = 1343270921;
constexpr int64_t kUnlinkFailed = 1343270922;
constexpr int64_t kFeatureNotEnabled = 1343270937;
constexpr int64_t kTimeout = 1343270938;
constexpr int64_t kLinkBusy = 1343270939;
constexpr int64_t kFailed = 4294967295LL;
}  // namespace status

struct Status {
  int64_t code = status::kSuccess;
  std::string message;

  bool ok() const { return code == status::kSuccess; }
  static Status Ok() { return {}; }
  static Status Error(int64_t c, std::string m) { return {c, std::move(m)}; }
};

struct EngineOptions {
  int64_t cluster_id = 0;
  std::string listen_host;
  int listen_port = -1;  // -1: no listener, 0: ephemeral
  std::string auth_token;
  std::string transport = "auto";  // auto | cma | tcp
  int tcp_connections = 2;
  int transfer_threads = 2;
  // The listener's caps: connections in the handshake at once, authenticated connections
  // (a link holds 1 + tcp_connections), and its event-loop threads (0: one per core, <= 8).
  int server_handshakes = 1024;
  int server_connections = 4096;
  int server_threads = 0;
  // link() tells the peer where to link back (return_paths.h), opening a return listener
  // when this engine has none; off: links go one way and nothing more listens.
  bool links_both_ways = true;
};

struct CacheKey {
  int64_t req_id = -1;
  int64_t prefix_id = -1;
  int64_t model_id = -1;
};

struct CacheRegistration {
  int64_t cache_id = 0;
  std::vector<uint64_t> tensor_addrs;
  uint64_t tensor_bytes = 0;
  uint64_t num_blocks = 0;  // batch size for contiguous caches
  bool is_blocks = true;
  bool remote_accessible = true;
  // A blocks cache peers write only into blocks granted to them (grant_writes).
  bool writes_by_grant = false;
  int64_t blocks_model_id = -1;
  std::vector<CacheKey> cache_keys;
};

enum RemoteKind : int { kBlocksByModel = 0, kCacheById = 1, kCacheByKey = 2 };

// What a pull and a push both name: the source and destination blocks (src_blocks[i] lands
// on dst_blocks[i]), the tensors of each side they cover (count -1: from first to the last),
// and how long the transfer may take.
struct BlockTransfer {
  std::vector<int64_t> src_blocks;
  std::vector<int64_t> dst_blocks;
  int64_t src_tensor_first = 0;
  int64_t src_tensor_count = -1;
  int64_t dst_tensor_first = 0;
  int64_t dst_tensor_count = -1;
  int64_t timeout_ms = 1000;
};

struct PullRequest : BlockTransfer {
  int64_t remote_cluster_id = 0;
  int remote_kind = kBlocksByModel;
  int64_t model_id = -1;
  int64_t cache_id = -1;
  int64_t req_id = -1;
  int64_t prefix_id = -1;
  int64_t batch_index = 0;
  int64_t dst_cache_id = 0;
  // pull_cache: >= 0 names the row of a contiguous local cache the source row lands in
  // (dst_blocks then empty), `size` bytes of each tensor (-1: the local row's length).
  int64_t dst_batch_index = -1;
  int64_t size = -1;
};

// A write into a linked peer's cache. push_blocks: src_blocks[i] of the local blocks cache
// lands on dst_blocks[i] of the peer's blocks cache registered under model_id. push_cache
// (remote_kind kCacheById, src_batch_index >= 0): row src_batch_index of a contiguous local
// cache lands on row batch_index of the peer's cache cache_id.
struct PushRequest : BlockTransfer {
  int64_t remote_cluster_id = 0;
  int remote_kind = kBlocksByModel;
  int64_t model_id = -1;
  int64_t cache_id = -1;
  int64_t batch_index = 0;
  int64_t src_batch_index = -1;
  int64_t src_cache_id = 0;
  // The write grant (grant_writes on the peer) this write is made under: a peer cache
  // registered writes_by_grant takes it only into blocks of exactly that grant. 0 names none;
  // caches not written by grant ignore it.
  uint64_t grant = 0;
};

// Thread-safe engine. Constructor throws std::invalid_argument for bad options and
// std::runtime_error when the listener cannot bind.
class Engine {
 public:
  explicit Engine(const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int64_t cluster_id() const;
  int listen_port() const;  // -1 while not listening
  // Starts the listener an engine built without one lacks (port 0: ephemeral); *bound gets
  // the port. Listening already on that port (or any, with port 0) is success.
  Status listen(const std::string& host, int port, int* bound);
  // Closes the listener and the connections it serves; the engine's own links stay.
  void stop_listening();

  Status register_cache(const CacheRegistration& reg);
  Status unregister_cache(int64_t cache_id);

  Status link(int64_t remote_cluster_id, const std::string& host, int port, int64_t timeout_ms);
  Status unlink(int64_t remote_cluster_id, int64_t timeout_ms, bool force);
  std::string peer_transport(int64_t remote_cluster_id) const;
  // Fetches the peer's whole table again, caches it registered since the link included (a
  // link otherwise keeps to what the peer held when it was made).
  Status refresh_peer_table(int64_t remote_cluster_id, int64_t timeout_ms);

  Status pull(const PullRequest& request);
  // The requests in order, each complete before the next begins, on the transfer pool (or
  // the caller's thread for a small same-host batch): the first failure stops the rest, its
  // message naming its place. Lets a caller read a guard word, blocks and the guard word
  // again without returning to Python (and its lock) in between. Wait or poll for the
  // result, which also gives when the last byte landed (steady clock, nanoseconds).
  Status submit_pull_batch(std::vector<PullRequest> requests, uint64_t* handle);
  Status wait(uint64_t handle, int64_t timeout_ms, int64_t* finished_ns = nullptr);
  Status poll(uint64_t handle, int64_t* finished_ns = nullptr);

  // Writes blocks into a linked peer's remote-accessible blocks cache. The peer's server pins
  // that cache and checks every range before a byte lands in it.
  Status push(const PushRequest& request);

  // Lets `writer_cluster` write `blocks` of cache `cache_id` (registered writes_by_grant)
  // until revoke_writes(*grant), with writes that name *grant (PushRequest::grant); a block
  // belongs to one grant at a time. Ids start at random per engine, never 0 (write_grants.h).
  Status grant_writes(int64_t writer_cluster, int64_t cache_id, const std::vector<int64_t>& blocks,
                      uint64_t* grant);
  // Withdraws the grant and returns once no write under it is in flight (TIMEOUT when one
  // still is after timeout_ms; the grant stays withdrawn).
  Status revoke_writes(uint64_t grant, int64_t timeout_ms);
  // How many peers' writes have landed here so far, and a wait until that count differs
  // from `seen` (or `timeout_ms` passed): a process expecting a pushed word sleeps on this
  // rather than polling its memory.
  uint64_t writes_landed() const;
  uint64_t wait_for_writes(uint64_t seen, int64_t timeout_ms);

  void close();
  std::map<std::string, int64_t> stats() const;

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hixl
