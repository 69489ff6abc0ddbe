// References for benchmarks and self-tests, built only into hixl_connector._native_bench:
// nothing here is reachable from the runtime engine module.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace hixl {

// Seconds per planning of src -> dst over num_tensors tensors (never dereferenced).
double time_plan(const std::vector<int64_t>& src, const std::vector<int64_t>& dst,
                 int num_tensors, int iterations);
// The cma transport's schedule (chunks, dynamic claiming, threads) with memcpy in place of
// process_vm_readv: the in-process ceiling of a pull. Seconds, -1 on bad input.
double scatter_copy(const std::vector<uint64_t>& dst, const std::vector<uint64_t>& src,
                    const std::vector<uint64_t>& lengths, int threads);
// The same schedule reading `src` of process `pid` with bare process_vm_readv calls (1024
// iovec pairs each): the kernel's ceiling for the cma transport. -1 on a failed read.
double scatter_read_process(int pid, const std::vector<uint64_t>& dst,
                            const std::vector<uint64_t>& src,
                            const std::vector<uint64_t>& lengths, int threads);
// The tcp transport's ceiling: the same bytes streamed over `connections` bare loopback TCP
// connections of this process (TCP_NODELAY, as the engine's), one sender and one receiver
// thread each, writev straight from `src` and readv straight into `dst` (IOV_MAX ranges a
// call); no requests, no framing. Seconds, -1 on bad input or a failed socket call.
double tcp_stream(const std::vector<uint64_t>& dst, const std::vector<uint64_t>& src,
                  const std::vector<uint64_t>& lengths, int connections);
// Exercises ThreadPool and run_shares with throwing tasks and shares on real threads;
// returns what happened (see tests/engine/test_native_units.py).
std::map<std::string, int64_t> thread_pool_selftest();

}  // namespace hixl
