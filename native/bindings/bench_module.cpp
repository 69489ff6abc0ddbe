// nanobind bindings of hixl_connector._native_bench: benchmark references and self-tests.
// They copy between arbitrary addresses and read arbitrary processes, so they live apart
// from the runtime module _native, and the connector never imports this one.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <tuple>
#include <vector>

#include "../bench/bench_helpers.h"
#include "common/crypto.h"
#include "common/planner.h"
#include "convert.h"

namespace nb = nanobind;
using hixl_bindings::to_vector;

namespace {

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

// A binding of a copy reference `run(dst, src, lengths, n)`: the op lists are converted with
// the GIL held, then released for the copies.
template <typename Run>
auto over_op_lists(Run run) {
  return [run](nb::handle dst, nb::handle src, nb::handle lengths, int n) {
    OpLists ops(dst, src, lengths);
    nb::gil_scoped_release release;
    return run(ops.dst, ops.src, ops.lengths, n);
  };
}

nb::bytes digest_bytes(const hixl::Digest& d) {
  return nb::bytes(reinterpret_cast<const char*>(d.data()), d.size());
}

}  // namespace

NB_MODULE(_native_bench, m) {
  m.doc() = "hixl_connector native benchmark references and self-tests (not for the connector)";
  m.def(
      "plan_runs",
      [](nb::handle src, nb::handle dst) {
        auto s = to_vector<int64_t>(src, "src_blocks");
        auto d = to_vector<int64_t>(dst, "dst_blocks");
        if (s.size() != d.size()) {
          throw nb::value_error("src_blocks and dst_blocks differ in length");
        }
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
  m.def("scatter_copy", over_op_lists(hixl::scatter_copy), nb::arg("dst_addrs"),
        nb::arg("src_addrs"), nb::arg("lengths"), nb::arg("threads"));
  m.def(
      "scatter_read_process",
      [](int pid, nb::handle dst, nb::handle src, nb::handle lengths, int threads) {
        OpLists ops(dst, src, lengths);
        nb::gil_scoped_release release;
        return hixl::scatter_read_process(pid, ops.dst, ops.src, ops.lengths, threads);
      },
      nb::arg("pid"), nb::arg("dst_addrs"), nb::arg("src_addrs"), nb::arg("lengths"),
      nb::arg("threads"));
  m.def("tcp_stream", over_op_lists(hixl::tcp_stream), nb::arg("dst_addrs"),
        nb::arg("src_addrs"), nb::arg("lengths"), nb::arg("connections"));
  m.def("thread_pool_selftest", [] {
    nb::gil_scoped_release release;
    return hixl::thread_pool_selftest();
  });
  m.def(
      "hmac_sha256",
      [](nb::bytes key, nb::bytes data) {
        std::string k(key.c_str(), key.size());
        return digest_bytes(hixl::hmac_sha256(k, data.c_str(), data.size()));
      },
      nb::arg("key"), nb::arg("data"), "The HMAC-SHA256 link authentication uses.");
  m.def(
      "sha256",
      [](nb::bytes data) { return digest_bytes(hixl::sha256(data.c_str(), data.size())); },
      nb::arg("data"));
}
