// nanobind bindings of the runtime module hixl_connector._native: the engine facade and its
// status codes, nothing else (benchmark references live in _native_bench). The GIL is
// released for every call that may block.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <string>
#include <tuple>

#include "convert.h"
#include "hixl/engine.h"

namespace nb = nanobind;
using hixl_bindings::to_vector;
using Result = std::tuple<int64_t, std::string>;

namespace {

Result to_result(const hixl::Status& s) { return {s.code, s.message}; }

// One pull's arguments as Python passes them, in PULL_ARGS order: the parameter list of the
// pull binding and the element type of submit_pull_batch.
using PullArgs = std::tuple<int64_t, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            nb::handle, nb::handle, int64_t, int64_t, int64_t, int64_t, int64_t>;

// The block lists of a pull or push binding, converted with the GIL held.
void set_blocks(hixl::BlockTransfer* t, nb::handle src, nb::handle dst) {
  t->src_blocks = to_vector<int64_t>(src, "src_blocks");
  t->dst_blocks = to_vector<int64_t>(dst, "dst_blocks");
}

// The tensor ranges and timeout every pull and push binding takes last, in this order.
void set_ranges(hixl::BlockTransfer* t, int64_t src_first, int64_t src_count, int64_t dst_first,
                int64_t dst_count, int64_t timeout_ms) {
  t->src_tensor_first = src_first;
  t->src_tensor_count = src_count;
  t->dst_tensor_first = dst_first;
  t->dst_tensor_count = dst_count;
  t->timeout_ms = timeout_ms;
}

// The peer's cache a pull reads and the local cache it lands in: PULL_ARGS up to
// dst_cache_id, which pull_cache takes first too.
hixl::PullRequest pull_between(int64_t remote, int kind, int64_t model_id, int64_t cache_id,
                               int64_t req_id, int64_t prefix_id, int64_t batch_index,
                               int64_t dst_cache_id) {
  hixl::PullRequest r;
  r.remote_cluster_id = remote;
  r.remote_kind = kind;
  r.model_id = model_id;
  r.cache_id = cache_id;
  r.req_id = req_id;
  r.prefix_id = prefix_id;
  r.batch_index = batch_index;
  r.dst_cache_id = dst_cache_id;
  return r;
}

hixl::PullRequest make_request(const PullArgs& args) {
  const auto& [remote, kind, model_id, cache_id, req_id, prefix_id, batch_index, dst_cache_id,
               src, dst, src_first, src_count, dst_first, dst_count, timeout_ms] = args;
  hixl::PullRequest r =
      pull_between(remote, kind, model_id, cache_id, req_id, prefix_id, batch_index, dst_cache_id);
  set_blocks(&r, src, dst);
  set_ranges(&r, src_first, src_count, dst_first, dst_count, timeout_ms);
  return r;
}

// A binding taking PULL_ARGS: builds the request with the GIL held (the block lists are
// Python objects), then hands it to `issue` with the GIL released. The parameter list is
// spelled out from PullArgs because nanobind reads a binding's signature off its lambda.
template <typename Issue, typename... Args>
auto pull_binding(Issue issue, std::tuple<Args...>* /*signature*/) {
  return [issue](hixl::Engine& e, Args... args) {
    hixl::PullRequest r = make_request(PullArgs{args...});
    nb::gil_scoped_release release;
    return issue(e, std::move(r));
  };
}

template <typename Issue>
auto pull_binding(Issue issue) {
  return pull_binding(issue, static_cast<PullArgs*>(nullptr));
}

#define PULL_ARGS                                                                        \
  nb::arg("remote_cluster_id"), nb::arg("remote_kind"), nb::arg("model_id"),             \
      nb::arg("cache_id"), nb::arg("req_id"), nb::arg("prefix_id"), nb::arg("batch_index"), \
      nb::arg("dst_cache_id"), nb::arg("src_blocks"), nb::arg("dst_blocks"),             \
      nb::arg("src_tensor_first"), nb::arg("src_tensor_count"), nb::arg("dst_tensor_first"), \
      nb::arg("dst_tensor_count"), nb::arg("timeout_ms")

nb::tuple waited(const hixl::Status& s, int64_t finished_ns, bool timed) {
  if (timed) return nb::make_tuple(s.code, s.message, finished_ns);
  return nb::make_tuple(s.code, s.message);
}

// A batch of pulls from Python: each a tuple of the 15 arguments of `pull`, in order.
std::vector<hixl::PullRequest> batch_of(const std::vector<nb::tuple>& pulls) {
  std::vector<hixl::PullRequest> requests;
  requests.reserve(pulls.size());
  for (const nb::tuple& a : pulls) {
    if (a.size() != 15) throw nb::value_error("each pull of a batch takes 15 arguments");
    requests.push_back(make_request(nb::cast<PullArgs>(a)));
  }
  return requests;
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "hixl_connector native engine";
  m.attr("ABI_VERSION") = 9;  // 7: write grants, links_both_ways; 8: push names its grant;
  // 9: writes_landed, wait_for_writes
  m.attr("SUCCESS") = hixl::status::kSuccess;
  m.attr("PENDING") = hixl::status::kPending;
  m.attr("KV_CACHE_NOT_EXIST") = hixl::status::kKvCacheNotExist;
  m.attr("PARAM_INVALID") = hixl::status::kParamInvalid;
  m.attr("ENGINE_FINALIZED") = hixl::status::kEngineFinalized;
  m.attr("NOT_YET_LINK") = hixl::status::kNotYetLink;
  m.attr("ALREADY_LINK") = hixl::status::kAlreadyLink;
  m.attr("LINK_FAILED") = hixl::status::kLinkFailed;
  m.attr("UNLINK_FAILED") = hixl::status::kUnlinkFailed;
  m.attr("FEATURE_NOT_ENABLED") = hixl::status::kFeatureNotEnabled;
  m.attr("TIMEOUT") = hixl::status::kTimeout;
  m.attr("LINK_BUSY") = hixl::status::kLinkBusy;
  m.attr("FAILED") = hixl::status::kFailed;

  nb::class_<hixl::Engine>(m, "Engine")
      .def(
          "__init__",
          [](hixl::Engine* self, int64_t cluster_id, std::string listen_host, int listen_port,
             std::string auth_token, std::string transport, int tcp_connections,
             int transfer_threads, int server_handshakes, int server_connections,
             int server_threads, bool links_both_ways) {
            hixl::EngineOptions o;
            o.cluster_id = cluster_id;
            o.listen_host = std::move(listen_host);
            o.listen_port = listen_port;
            o.auth_token = std::move(auth_token);
            o.transport = std::move(transport);
            o.tcp_connections = tcp_connections;
            o.transfer_threads = transfer_threads;
            o.server_handshakes = server_handshakes;
            o.server_connections = server_connections;
            o.server_threads = server_threads;
            o.links_both_ways = links_both_ways;
            new (self) hixl::Engine(o);
          },
          nb::arg("cluster_id"), nb::arg("listen_host") = "", nb::arg("listen_port") = -1,
          nb::arg("auth_token") = "", nb::arg("transport") = "auto",
          nb::arg("tcp_connections") = 2, nb::arg("transfer_threads") = 2,
          nb::arg("server_handshakes") = 1024, nb::arg("server_connections") = 4096,
          nb::arg("server_threads") = 0, nb::arg("links_both_ways") = true)
      .def_prop_ro("cluster_id", &hixl::Engine::cluster_id)
      .def_prop_ro("listen_port", &hixl::Engine::listen_port)
      .def(
          "register_cache",
          [](hixl::Engine& e, int64_t cache_id, nb::handle tensor_addrs, uint64_t tensor_bytes,
             uint64_t num_blocks, bool is_blocks, bool remote_accessible,
             int64_t blocks_model_id, const std::vector<std::tuple<int64_t, int64_t, int64_t>>& keys,
             bool writes_by_grant) {
            hixl::CacheRegistration reg;
            reg.cache_id = cache_id;
            reg.tensor_addrs = to_vector<uint64_t>(tensor_addrs, "tensor_addrs");
            reg.tensor_bytes = tensor_bytes;
            reg.num_blocks = num_blocks;
            reg.is_blocks = is_blocks;
            reg.remote_accessible = remote_accessible;
            reg.blocks_model_id = blocks_model_id;
            reg.writes_by_grant = writes_by_grant;
            for (const auto& k : keys) {
              reg.cache_keys.push_back({std::get<0>(k), std::get<1>(k), std::get<2>(k)});
            }
            nb::gil_scoped_release release;
            return to_result(e.register_cache(reg));
          },
          nb::arg("cache_id"), nb::arg("tensor_addrs"), nb::arg("tensor_bytes"),
          nb::arg("num_blocks"), nb::arg("is_blocks"), nb::arg("remote_accessible"),
          nb::arg("blocks_model_id"), nb::arg("cache_keys"), nb::arg("writes_by_grant") = false)
      .def(
          "unregister_cache",
          [](hixl::Engine& e, int64_t cache_id) {
            nb::gil_scoped_release release;
            return to_result(e.unregister_cache(cache_id));
          },
          nb::arg("cache_id"))
      .def(
          "link",
          [](hixl::Engine& e, int64_t remote, const std::string& host, int port,
             int64_t timeout_ms) {
            nb::gil_scoped_release release;
            return to_result(e.link(remote, host, port, timeout_ms));
          },
          nb::arg("remote_cluster_id"), nb::arg("host"), nb::arg("port"), nb::arg("timeout_ms"))
      .def(
          "unlink",
          [](hixl::Engine& e, int64_t remote, int64_t timeout_ms, bool force) {
            nb::gil_scoped_release release;
            return to_result(e.unlink(remote, timeout_ms, force));
          },
          nb::arg("remote_cluster_id"), nb::arg("timeout_ms"), nb::arg("force"))
      .def("peer_transport", &hixl::Engine::peer_transport, nb::arg("remote_cluster_id"))
      .def(
          "refresh_peer_table",
          [](hixl::Engine& e, int64_t remote, int64_t timeout_ms) {
            nb::gil_scoped_release release;
            return to_result(e.refresh_peer_table(remote, timeout_ms));
          },
          nb::arg("remote_cluster_id"), nb::arg("timeout_ms"))
      .def(
          "listen",
          [](hixl::Engine& e, const std::string& host, int port) {
            int bound = -1;
            hixl::Status s;
            {
              nb::gil_scoped_release release;
              s = e.listen(host, port, &bound);
            }
            return std::tuple<int64_t, int, std::string>(s.code, bound, s.message);
          },
          nb::arg("host"), nb::arg("port"), "(status, bound port, message)")
      .def(
          "stop_listening",
          [](hixl::Engine& e) {
            nb::gil_scoped_release release;
            e.stop_listening();
          })
      .def("pull",
           pull_binding([](hixl::Engine& e, hixl::PullRequest r) { return to_result(e.pull(r)); }),
           PULL_ARGS)
      .def(
          "push",
          [](hixl::Engine& e, int64_t remote, int64_t model_id, int64_t src_cache_id,
             nb::handle src, nb::handle dst, int64_t src_first, int64_t src_count,
             int64_t dst_first, int64_t dst_count, int64_t timeout_ms, int remote_kind,
             int64_t cache_id, int64_t batch_index, int64_t src_batch_index, uint64_t grant) {
            hixl::PushRequest r;
            r.remote_cluster_id = remote;
            r.remote_kind = remote_kind;
            r.cache_id = cache_id;
            r.batch_index = batch_index;
            r.src_batch_index = src_batch_index;
            r.model_id = model_id;
            r.src_cache_id = src_cache_id;
            set_blocks(&r, src, dst);
            set_ranges(&r, src_first, src_count, dst_first, dst_count, timeout_ms);
            r.grant = grant;
            nb::gil_scoped_release release;
            return to_result(e.push(r));
          },
          nb::arg("remote_cluster_id"), nb::arg("model_id"), nb::arg("src_cache_id"),
          nb::arg("src_blocks"), nb::arg("dst_blocks"), nb::arg("src_tensor_first"),
          nb::arg("src_tensor_count"), nb::arg("dst_tensor_first"), nb::arg("dst_tensor_count"),
          nb::arg("timeout_ms"), nb::arg("remote_kind") = 0, nb::arg("cache_id") = -1,
          nb::arg("batch_index") = 0, nb::arg("src_batch_index") = -1, nb::arg("grant") = 0,
          "push_blocks; with remote_kind 1 and src_batch_index >= 0, push_cache: that row of "
          "the local contiguous cache onto row batch_index of the peer's cache cache_id. "
          "grant: the peer's write grant the write is under (0: none), which a peer cache "
          "registered writes_by_grant requires")
      .def(
          "grant_writes",
          [](hixl::Engine& e, int64_t writer, int64_t cache_id, nb::handle blocks) {
            std::vector<int64_t> granted = to_vector<int64_t>(blocks, "blocks");
            uint64_t grant = 0;
            nb::gil_scoped_release release;
            hixl::Status s = e.grant_writes(writer, cache_id, granted, &grant);
            return std::make_tuple(s.code, s.message, grant);
          },
          nb::arg("writer_cluster_id"), nb::arg("cache_id"), nb::arg("blocks"),
          "(status, message, grant id): lets the writer write those blocks of a cache "
          "registered writes_by_grant")
      .def(
          "revoke_writes",
          [](hixl::Engine& e, uint64_t grant, int64_t timeout_ms) {
            nb::gil_scoped_release release;
            return to_result(e.revoke_writes(grant, timeout_ms));
          },
          nb::arg("grant"), nb::arg("timeout_ms"),
          "withdraws a grant; returns once no write under it is in flight (TIMEOUT otherwise)")
      .def("writes_landed", &hixl::Engine::writes_landed,
           "how many peers' writes have landed in this engine so far")
      .def(
          "wait_for_writes",
          [](hixl::Engine& e, uint64_t seen, int64_t timeout_ms) {
            nb::gil_scoped_release release;
            return e.wait_for_writes(seen, timeout_ms);
          },
          nb::arg("seen"), nb::arg("timeout_ms"),
          "the landed-writes count once it differs from seen, or after timeout_ms")
      .def(
          "pull_cache",
          [](hixl::Engine& e, int64_t remote, int kind, int64_t model_id, int64_t cache_id,
             int64_t req_id, int64_t prefix_id, int64_t batch_index, int64_t dst_cache_id,
             int64_t dst_batch_index, int64_t size, int64_t src_first, int64_t src_count,
             int64_t dst_first, int64_t dst_count, int64_t timeout_ms) {
            hixl::PullRequest r = pull_between(remote, kind, model_id, cache_id, req_id,
                                               prefix_id, batch_index, dst_cache_id);
            r.dst_batch_index = dst_batch_index;
            r.size = size;
            set_ranges(&r, src_first, src_count, dst_first, dst_count, timeout_ms);
            nb::gil_scoped_release release;
            return to_result(e.pull(r));
          },
          nb::arg("remote_cluster_id"), nb::arg("remote_kind"), nb::arg("model_id"),
          nb::arg("cache_id"), nb::arg("req_id"), nb::arg("prefix_id"), nb::arg("batch_index"),
          nb::arg("dst_cache_id"), nb::arg("dst_batch_index"), nb::arg("size"),
          nb::arg("src_tensor_first"), nb::arg("src_tensor_count"), nb::arg("dst_tensor_first"),
          nb::arg("dst_tensor_count"), nb::arg("timeout_ms"),
          "pull_cache: the peer's row into row dst_batch_index of a local contiguous cache")
      .def(
          "submit_pull_batch",
          [](hixl::Engine& e, const std::vector<nb::tuple>& pulls) {
            std::vector<hixl::PullRequest> requests = batch_of(pulls);
            nb::gil_scoped_release release;
            uint64_t handle = 0;
            hixl::Status s = e.submit_pull_batch(std::move(requests), &handle);
            return std::tuple<int64_t, uint64_t, std::string>(s.code, handle, s.message);
          },
          nb::arg("pulls"))
      .def(
          "wait",
          [](hixl::Engine& e, uint64_t handle, int64_t timeout_ms, bool timed) {
            int64_t finished_ns = 0;
            hixl::Status s;
            {
              nb::gil_scoped_release release;
              s = e.wait(handle, timeout_ms, &finished_ns);
            }
            return waited(s, finished_ns, timed);
          },
          nb::arg("handle"), nb::arg("timeout_ms"), nb::arg("timed") = false,
          "(status, message), with timed=True also when the last byte landed "
          "(nanoseconds on time.monotonic_ns's clock)")
      .def(
          "poll",
          [](hixl::Engine& e, uint64_t handle, bool timed) {
            int64_t finished_ns = 0;
            hixl::Status s;
            {
              nb::gil_scoped_release release;
              s = e.poll(handle, &finished_ns);
            }
            return waited(s, finished_ns, timed);
          },
          nb::arg("handle"), nb::arg("timed") = false)
      .def(
          "close",
          [](hixl::Engine& e) {
            nb::gil_scoped_release release;
            e.close();
          })
      .def("stats", &hixl::Engine::stats);
}
