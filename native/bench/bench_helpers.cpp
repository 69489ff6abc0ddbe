// Planner timing, an in-process copy reference, bare process_vm_readv and bare socket
// references, and the thread pool's self-test.
#include "bench_helpers.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <future>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>

#include "common/planner.h"
#include "common/thread_pool.h"
#include "transports/transport.h"
#include "common/wire.h"

namespace hixl {

double time_plan(const std::vector<int64_t>& src, const std::vector<int64_t>& dst,
                 int num_tensors, int iterations) {
  if (iterations < 1 || num_tensors < 1 || src.size() != dst.size() || src.empty()) return 0.0;
  int64_t max_id = 0;
  for (size_t i = 0; i < src.size(); ++i) max_id = std::max({max_id, src[i], dst[i]});
  const uint64_t stride = 4096;
  CacheInfo cache;
  cache.num_blocks = static_cast<uint64_t>(max_id) + 1;
  cache.tensor_bytes = cache.num_blocks * stride;
  for (int t = 0; t < num_tensors; ++t) {
    cache.tensor_addrs.push_back((uint64_t(t) + 1) << 40);  // never dereferenced
  }
  PullRequest req;
  req.src_blocks = src;
  req.dst_blocks = dst;
  std::vector<Op> ops;
  auto start = Clock::now();
  for (int i = 0; i < iterations; ++i) {
    ResolvedRange range;
    uint64_t runs = 0;
    if (!check_local(req, cache, &range).ok() ||
        !build_ops(req, cache, range, cache, &ops, &runs).ok()) {
      return -1.0;
    }
  }
  std::chrono::duration<double> elapsed = Clock::now() - start;
  return elapsed.count() / iterations;
}

namespace {

// Runs `copy_chunk(ops, begin, end)` over the cma transport's chunks and dynamic claiming,
// with the same thread count. The pool is started before the clock so thread creation is
// not charged to the copy. Returns seconds, or -1 when a chunk failed.
template <class CopyChunk>
double timed_schedule(const std::vector<uint64_t>& dst, const std::vector<uint64_t>& src,
                      const std::vector<uint64_t>& lengths, int threads, CopyChunk copy_chunk) {
  if (dst.size() != src.size() || dst.size() != lengths.size()) return -1.0;
  threads = std::max(1, threads);
  std::vector<Op> ops(dst.size());
  for (size_t i = 0; i < dst.size(); ++i) ops[i] = {dst[i], src[i], lengths[i]};
  ThreadPool pool(threads - 1);
  std::atomic<bool> failed{false};
  auto start = Clock::now();
  std::vector<OpCursor> cuts = cut_ops(ops, chunk_count(total_bytes(ops), threads));
  run_shares(
      pool, cuts.size() - 1,
      [&](size_t i) {
        if (!copy_chunk(ops, cuts[i], cuts[i + 1])) failed.store(true);
      },
      static_cast<size_t>(threads - 1));
  std::chrono::duration<double> elapsed = Clock::now() - start;
  return failed.load() ? -1.0 : elapsed.count();
}

}  // namespace

double scatter_copy(const std::vector<uint64_t>& dst, const std::vector<uint64_t>& src,
                    const std::vector<uint64_t>& lengths, int threads) {
  return timed_schedule(dst, src, lengths, threads,
                        [](const std::vector<Op>& ops, OpCursor begin, OpCursor end) {
                          return for_each_piece(ops, begin, end,
                                                [](uint64_t to, uint64_t from, uint64_t len) {
                                                  std::memcpy(reinterpret_cast<void*>(to),
                                                              reinterpret_cast<const void*>(from),
                                                              len);
                                                  return true;
                                                });
                        });
}

std::map<std::string, int64_t> thread_pool_selftest() {
  std::map<std::string, int64_t> out;
  ThreadPool pool(2);
  std::atomic<int64_t> ran{0};
  // A task that throws must not end its worker: the task after it still runs.
  pool.post([] { throw std::runtime_error("task"); });
  pool.post([&] { ran++; });
  // A share that throws: run_shares rethrows in the caller once the shares in flight ended.
  constexpr size_t kShares = 64;
  std::atomic<int64_t> shares_run{0};
  try {
    run_shares(pool, kShares, [&](size_t i) {
      if (i == 5) throw std::runtime_error("share 5");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));  // so skipping shows
      shares_run++;
    });
    out["rethrown"] = 0;
  } catch (const std::runtime_error& e) {
    out["rethrown"] = std::string(e.what()) == "share 5" ? 1 : -1;
  }
  const int64_t after_return = shares_run.load();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  out["shares_run_after_return"] = shares_run.load() - after_return;  // must stay 0
  out["shares_run_before_failure_or_in_flight"] = after_return;
  // The same pool still runs every share of the next call.
  std::atomic<int64_t> second{0};
  run_shares(pool, kShares, [&](size_t) { second++; });
  out["second_call_shares"] = second.load();
  pool.shutdown();
  out["task_after_throwing_task_ran"] = ran.load();
  out["task_failures"] = pool.task_failures();
  return out;
}

double scatter_read_process(int pid, const std::vector<uint64_t>& dst,
                            const std::vector<uint64_t>& src,
                            const std::vector<uint64_t>& lengths, int threads) {
  auto read_chunk = [pid](const std::vector<Op>& ops, OpCursor begin, OpCursor end) {
    iovec local[kIovMax];
    iovec remote[kIovMax];
    size_t count = 0;
    uint64_t expected = 0;
    auto flush = [&] {
      ssize_t n = ::process_vm_readv(pid, local, count, remote, count, 0);
      bool ok = n >= 0 && static_cast<uint64_t>(n) == expected;
      count = 0;
      expected = 0;
      return ok;
    };
    bool ok = for_each_piece(ops, begin, end, [&](uint64_t to, uint64_t from, uint64_t len) {
      local[count] = {reinterpret_cast<void*>(to), len};
      remote[count] = {reinterpret_cast<void*>(from), len};
      expected += len;
      return ++count < kIovMax || flush();
    });
    return ok && (count == 0 || flush());
  };
  return timed_schedule(dst, src, lengths, threads, read_chunk);
}

namespace {

// Moves every byte of `iov` through `fd` with writev (send) or readv (receive), up to IOV_MAX
// ranges a call, resuming after partial transfers.
bool transfer_all(int fd, std::vector<iovec>& iov, bool send) {
  size_t i = 0;
  while (i < iov.size()) {
    int count = static_cast<int>(std::min<size_t>(iov.size() - i, kIovMax));
    ssize_t n = send ? ::writev(fd, &iov[i], count) : ::readv(fd, &iov[i], count);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    for (auto left = static_cast<uint64_t>(n); left > 0;) {
      uint64_t step = std::min<uint64_t>(left, iov[i].iov_len);
      iov[i].iov_base = static_cast<char*>(iov[i].iov_base) + step;
      iov[i].iov_len -= step;
      left -= step;
      if (iov[i].iov_len == 0) ++i;
    }
    while (i < iov.size() && iov[i].iov_len == 0) ++i;
  }
  return true;
}

// The ranges of one share, on the sending (`from`) or the receiving (`to`) side.
std::vector<iovec> share_ranges(const std::vector<Op>& ops, OpCursor begin, OpCursor end,
                                bool sending) {
  std::vector<iovec> iov;
  for_each_piece(ops, begin, end, [&](uint64_t to, uint64_t from, uint64_t len) {
    iov.push_back({reinterpret_cast<void*>(sending ? from : to), len});
    return true;
  });
  return iov;
}

// `count` connected loopback pairs: (sending end, receiving end) each.
bool loopback_pairs(size_t count, std::vector<UniqueFd>* out, std::vector<UniqueFd>* in) {
  UniqueFd listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  auto* any = reinterpret_cast<sockaddr*>(&addr);
  if (!listener.valid() || ::bind(listener.get(), any, sizeof(addr)) != 0 ||
      ::listen(listener.get(), static_cast<int>(count)) != 0 ||
      ::getsockname(listener.get(), any, &len) != 0) {
    return false;
  }
  for (size_t c = 0; c < count; ++c) {
    UniqueFd sending(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!sending.valid() || ::connect(sending.get(), any, sizeof(addr)) != 0) return false;
    UniqueFd receiving(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!receiving.valid()) return false;
    wire::set_nodelay(sending.get());
    wire::set_nodelay(receiving.get());
    out->push_back(std::move(sending));
    in->push_back(std::move(receiving));
  }
  return true;
}

}  // namespace

double tcp_stream(const std::vector<uint64_t>& dst, const std::vector<uint64_t>& src,
                  const std::vector<uint64_t>& lengths, int connections) {
  if (dst.size() != src.size() || dst.size() != lengths.size() || connections < 1) return -1.0;
  std::vector<Op> ops(dst.size());
  for (size_t i = 0; i < dst.size(); ++i) ops[i] = {dst[i], src[i], lengths[i]};
  std::vector<OpCursor> cuts = cut_ops(ops, static_cast<size_t>(connections));
  size_t shares = cuts.size() - 1;
  std::vector<UniqueFd> out, in;
  if (!loopback_pairs(shares, &out, &in)) return -1.0;
  std::promise<void> go;
  std::shared_future<void> started = go.get_future().share();
  std::atomic<bool> failed{false};
  std::vector<std::thread> threads;
  for (size_t s = 0; s < shares; ++s) {
    for (bool sending : {true, false}) {
      threads.emplace_back([&, s, sending] {
        std::vector<iovec> iov = share_ranges(ops, cuts[s], cuts[s + 1], sending);
        started.wait();
        if (!transfer_all((sending ? out : in)[s].get(), iov, sending)) failed.store(true);
      });
    }
  }
  auto start = Clock::now();
  go.set_value();
  for (auto& t : threads) t.join();
  std::chrono::duration<double> elapsed = Clock::now() - start;
  return failed.load() ? -1.0 : elapsed.count();
}

}  // namespace hixl
