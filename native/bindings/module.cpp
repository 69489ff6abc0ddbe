// nanobind bindings: the only interface between the C++ engine and Python
// (contract: hixl_connector._native). The GIL is released for every call that may block.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <string>
#include <tuple>

#include "hixl/engine.h"
#include "../src/crypto.h"

namespace nb = nanobind;
using Result = std::tuple<int64_t, std::string>;

namespace {

Result to_result(const hixl::Status& s) { return {s.code, s.message}; }

template <typename Elem, typename Out>
bool copy_array(nb::handle h, std::vector<Out>* out) {
  nb::ndarray<const Elem, nb::ndim<1>, nb::device::cpu> a;
  if (!nb::try_cast(h, a, false)) return false;
  out->resize(a.shape(0));
  const Elem* data = a.data();
  const int64_t stride = a.stride(0);
  for (size_t i = 0; i < out->size(); ++i) {
    (*out)[i] = static_cast<Out>(data[static_cast<int64_t>(i) * stride]);
  }
  return true;
}

// Accepts a 1-D int64/uint64 numpy array (no per-element Python work) or any int sequence.
template <typename Out>
std::vector<Out> to_vector(nb::handle h, const char* name) {
  std::vector<Out> out;
  if (nb::ndarray_check(h) &&
      (copy_array<int64_t>(h, &out) || copy_array<uint64_t>(h, &out))) {
    return out;
  }
  if (!nb::isinstance<nb::sequence>(h) || nb::isinstance<nb::str>(h)) {
    throw nb::type_error((std::string(name) + " must be a sequence of int or a 1-D int64/uint64 array")
                             .c_str());
  }
  nb::sequence seq = nb::borrow<nb::sequence>(h);
  out.reserve(nb::len(seq));
  for (nb::handle item : seq) {
    Out v;
    if (!nb::try_cast(item, v)) {
      throw nb::type_error((std::string(name) + " holds a non-integer or out-of-range value")
                               .c_str());
    }
    out.push_back(v);
  }
  return out;
}

// The op lists of the copy references: equal-length address and length sequences.
struct OpLists {
  OpLists(nb::handle d, nb::handle s, nb::handle l)
      : dst(to_vector<uint64_t>(d, "dst_addrs")),
        src(to_vector<uint64_t>(s, "src_addrs")),
        lengths(to_vector<uint64_t>(l, "lengths")) {
    if (dst.size() != src.size() || dst.size() != lengths.size()) {
      throw nb::value_error("dst_addrs, src_addrs and lengths differ in length");
    }
  }
  std::vector<uint64_t> dst, src, lengths;
};

hixl::PullRequest make_request(int64_t remote, int kind, int64_t model_id, int64_t cache_id,
                               int64_t req_id, int64_t prefix_id, int64_t batch_index,
                               int64_t dst_cache_id, nb::handle src, nb::handle dst,
                               int64_t src_first, int64_t src_count, int64_t dst_first,
                               int64_t dst_count, int64_t timeout_ms) {
  hixl::PullRequest r;
  r.remote_cluster_id = remote;
  r.remote_kind = kind;
  r.model_id = model_id;
  r.cache_id = cache_id;
  r.req_id = req_id;
  r.prefix_id = prefix_id;
  r.batch_index = batch_index;
  r.dst_cache_id = dst_cache_id;
  r.src_blocks = to_vector<int64_t>(src, "src_blocks");
  r.dst_blocks = to_vector<int64_t>(dst, "dst_blocks");
  r.src_tensor_first = src_first;
  r.src_tensor_count = src_count;
  r.dst_tensor_first = dst_first;
  r.dst_tensor_count = dst_count;
  r.timeout_ms = timeout_ms;
  return r;
}

#define PULL_ARGS                                                                        \
  nb::arg("remote_cluster_id"), nb::arg("remote_kind"), nb::arg("model_id"),             \
      nb::arg("cache_id"), nb::arg("req_id"), nb::arg("prefix_id"), nb::arg("batch_index"), \
      nb::arg("dst_cache_id"), nb::arg("src_blocks"), nb::arg("dst_blocks"),             \
      nb::arg("src_tensor_first"), nb::arg("src_tensor_count"), nb::arg("dst_tensor_first"), \
      nb::arg("dst_tensor_count"), nb::arg("timeout_ms")

nb::bytes digest_bytes(const hixl::Digest& d) {
  return nb::bytes(reinterpret_cast<const char*>(d.data()), d.size());
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "hixl_connector native engine";
  m.attr("ABI_VERSION") = 1;
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
             int transfer_threads) {
            hixl::EngineOptions o;
            o.cluster_id = cluster_id;
            o.listen_host = std::move(listen_host);
            o.listen_port = listen_port;
            o.auth_token = std::move(auth_token);
            o.transport = std::move(transport);
            o.tcp_connections = tcp_connections;
            o.transfer_threads = transfer_threads;
            new (self) hixl::Engine(o);
          },
          nb::arg("cluster_id"), nb::arg("listen_host") = "", nb::arg("listen_port") = -1,
          nb::arg("auth_token") = "", nb::arg("transport") = "auto",
          nb::arg("tcp_connections") = 2, nb::arg("transfer_threads") = 2)
      .def_prop_ro("cluster_id", &hixl::Engine::cluster_id)
      .def_prop_ro("listen_port", &hixl::Engine::listen_port)
      .def(
          "register_cache",
          [](hixl::Engine& e, int64_t cache_id, nb::handle tensor_addrs, uint64_t tensor_bytes,
             uint64_t num_blocks, bool is_blocks, bool remote_accessible,
             int64_t blocks_model_id, const std::vector<std::tuple<int64_t, int64_t, int64_t>>& keys) {
            hixl::CacheRegistration reg;
            reg.cache_id = cache_id;
            reg.tensor_addrs = to_vector<uint64_t>(tensor_addrs, "tensor_addrs");
            reg.tensor_bytes = tensor_bytes;
            reg.num_blocks = num_blocks;
            reg.is_blocks = is_blocks;
            reg.remote_accessible = remote_accessible;
            reg.blocks_model_id = blocks_model_id;
            for (const auto& k : keys) {
              reg.cache_keys.push_back({std::get<0>(k), std::get<1>(k), std::get<2>(k)});
            }
            nb::gil_scoped_release release;
            return to_result(e.register_cache(reg));
          },
          nb::arg("cache_id"), nb::arg("tensor_addrs"), nb::arg("tensor_bytes"),
          nb::arg("num_blocks"), nb::arg("is_blocks"), nb::arg("remote_accessible"),
          nb::arg("blocks_model_id"), nb::arg("cache_keys"))
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
          "pull",
          [](hixl::Engine& e, int64_t remote, int kind, int64_t model_id, int64_t cache_id,
             int64_t req_id, int64_t prefix_id, int64_t batch_index, int64_t dst_cache_id,
             nb::handle src, nb::handle dst, int64_t src_first, int64_t src_count,
             int64_t dst_first, int64_t dst_count, int64_t timeout_ms) {
            hixl::PullRequest r =
                make_request(remote, kind, model_id, cache_id, req_id, prefix_id, batch_index,
                             dst_cache_id, src, dst, src_first, src_count, dst_first, dst_count,
                             timeout_ms);
            nb::gil_scoped_release release;
            return to_result(e.pull(r));
          },
          PULL_ARGS)
      .def(
          "submit_pull",
          [](hixl::Engine& e, int64_t remote, int kind, int64_t model_id, int64_t cache_id,
             int64_t req_id, int64_t prefix_id, int64_t batch_index, int64_t dst_cache_id,
             nb::handle src, nb::handle dst, int64_t src_first, int64_t src_count,
             int64_t dst_first, int64_t dst_count, int64_t timeout_ms) {
            hixl::PullRequest r =
                make_request(remote, kind, model_id, cache_id, req_id, prefix_id, batch_index,
                             dst_cache_id, src, dst, src_first, src_count, dst_first, dst_count,
                             timeout_ms);
            nb::gil_scoped_release release;
            uint64_t handle = 0;
            hixl::Status s = e.submit_pull(std::move(r), &handle);
            return std::tuple<int64_t, uint64_t, std::string>(s.code, handle, s.message);
          },
          PULL_ARGS)
      .def(
          "wait",
          [](hixl::Engine& e, uint64_t handle, int64_t timeout_ms) {
            nb::gil_scoped_release release;
            return to_result(e.wait(handle, timeout_ms));
          },
          nb::arg("handle"), nb::arg("timeout_ms"))
      .def(
          "poll",
          [](hixl::Engine& e, uint64_t handle) {
            nb::gil_scoped_release release;
            return to_result(e.poll(handle));
          },
          nb::arg("handle"))
      .def(
          "close",
          [](hixl::Engine& e) {
            nb::gil_scoped_release release;
            e.close();
          })
      .def("stats", &hixl::Engine::stats);

  m.def(
      "plan_runs",
      [](nb::handle src, nb::handle dst) {
        auto s = to_vector<int64_t>(src, "src_blocks");
        auto d = to_vector<int64_t>(dst, "dst_blocks");
        if (s.size() != d.size()) throw nb::value_error("src_blocks and dst_blocks differ in length");
        std::vector<std::tuple<uint64_t, uint64_t, uint64_t>> out;
        for (const auto& r : hixl::plan_runs(s.data(), d.data(), s.size())) {
          out.emplace_back(r.src_start, r.dst_start, r.length);
        }
        return out;
      },
      nb::arg("src_blocks"), nb::arg("dst_blocks"));
  m.def(
      "time_plan",
      [](nb::handle src, nb::handle dst, int num_tensors, int iterations) {
        auto s = to_vector<int64_t>(src, "src_blocks");
        auto d = to_vector<int64_t>(dst, "dst_blocks");
        nb::gil_scoped_release release;
        return hixl::time_plan(s, d, num_tensors, iterations);
      },
      nb::arg("src_blocks"), nb::arg("dst_blocks"), nb::arg("num_tensors"),
      nb::arg("iterations"));
  m.def(
      "scatter_copy",
      [](nb::handle dst, nb::handle src, nb::handle lengths, int threads) {
        OpLists ops(dst, src, lengths);
        nb::gil_scoped_release release;
        return hixl::scatter_copy(ops.dst, ops.src, ops.lengths, threads);
      },
      nb::arg("dst_addrs"), nb::arg("src_addrs"), nb::arg("lengths"), nb::arg("threads"));
  m.def("thread_pool_selftest", [] {
    nb::gil_scoped_release release;
    return hixl::thread_pool_selftest();
  });
  m.def(
      "scatter_read_process",
      [](int pid, nb::handle dst, nb::handle src, nb::handle lengths, int threads) {
        OpLists ops(dst, src, lengths);
        nb::gil_scoped_release release;
        return hixl::scatter_read_process(pid, ops.dst, ops.src, ops.lengths, threads);
      },
      nb::arg("pid"), nb::arg("dst_addrs"), nb::arg("src_addrs"), nb::arg("lengths"),
      nb::arg("threads"));
  m.def(
      "hmac_sha256",
      [](nb::bytes key, nb::bytes data) {
        std::string k(key.c_str(), key.size());
        return digest_bytes(hixl::hmac_sha256(k, data.c_str(), data.size()));
      },
      nb::arg("key"), nb::arg("data"), "HMAC-SHA256 used by link authentication (for tests).");
  m.def(
      "sha256",
      [](nb::bytes data) { return digest_bytes(hixl::sha256(data.c_str(), data.size())); },
      nb::arg("data"));
}
