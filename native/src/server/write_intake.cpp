#include "server/write_intake.h"

#include <sys/socket.h>

#include <cerrno>
#include <algorithm>
#include <climits>
#include <string>

#include "common/handshake.h"

namespace hixl {
namespace {

constexpr int kSameHostCopyLimitMs = 60 * 1000;

Status invalid(const std::string& why) { return Status::Error(status::kParamInvalid, why); }

// The writer's pid, checked by reading its probe bytes in its memory: a pid alone could name
// any process on this host.
Status prove(wire::Decoder& dec, ProvenWriter* writer) {
  int64_t pid = 0;
  uint64_t probe_addr = 0;
  uint8_t probe[kProbeBytes] = {};
  if (!dec.i64(&pid) || !dec.u64(&probe_addr) || !dec.raw(probe, sizeof(probe)) ||
      dec.remaining() != 0 || pid <= 0 || pid > INT_MAX) {
    return invalid("malformed write request");
  }
  if (writer->pidfd.valid() && writer->pid == pid) return Status::Ok();
  UniqueFd pidfd;
  Status s = cma_probe(static_cast<int>(pid), probe_addr, probe, sizeof(probe), &pidfd);
  if (!s.ok()) return Status::Error(status::kFailed, "cannot copy from the writer: " + s.message);
  writer->pid = pid;
  writer->pidfd = std::move(pidfd);
  return Status::Ok();
}

}  // namespace

WriteIntake::WriteIntake(CacheTable::Pin pin, WriteGrants::Hold hold, std::vector<iovec> iov,
                         uint64_t total, MemoryMeter& meter)
    : pin_(std::move(pin)),
      hold_(std::move(hold)),
      iov_(std::move(iov)),
      total_(total),
      charge_(meter, static_cast<int64_t>(iov_.capacity() * sizeof(iovec))) {
  first_ = wire::advance_iov(iov_.data(), iov_.size(), 0, 0);  // past empty ranges
}

WriteIntake::Outcome WriteIntake::start(const std::vector<uint8_t>& payload,
                                        const CacheTable& table, WriteGrants& grants,
                                        int64_t writer_cluster, ProvenWriter* writer,
                                        const Copiers& copiers, MemoryMeter& meter,
                                        std::unique_ptr<WriteIntake>* out, Status* refusal,
                                        uint64_t* bytes) {
  wire::Decoder dec(payload.data(), payload.size());
  uint64_t serial = 0;
  uint64_t grant = 0;  // the write grant the writer names; only a writes_by_grant cache reads it
  uint8_t source = 0;
  uint32_t n = 0;
  const bool framed = dec.u64(&serial) && dec.u64(&grant) && dec.u8(&source) && dec.u32(&n) &&
                      n > 0 && n <= wire::kMaxReadOps && dec.remaining() >= uint64_t(n) * 16;
  if (!framed || (source != wire::kBytesFollow && source != wire::kFromWriter) ||
      (source == wire::kBytesFollow && dec.remaining() != uint64_t(n) * 16)) {
    *refusal = invalid("malformed write request");
    return Outcome::kRefused;
  }
  CacheTable::Pin pin = table.pin_remote_by_serial(serial);
  std::vector<Op> ops(n);
  uint64_t total = 0;
  for (Op& op : ops) {
    dec.u64(&op.local);
    dec.u64(&op.len);
    total += op.len;
  }
  if (source == wire::kFromWriter) {
    for (Op& op : ops) {
      if (!dec.u64(&op.remote)) {
        *refusal = invalid("malformed write request");
        return Outcome::kRefused;
      }
    }
    *refusal = prove(dec, writer);
    if (!refusal->ok()) return Outcome::kRefused;
  }
  if (!pin) return Outcome::kStale;
  for (const Op& op : ops) {
    if (!pin.contains(op.local, op.len)) {
      *refusal = invalid("range [" + std::to_string(op.local) + ", +" + std::to_string(op.len) +
                         ") is outside the tensors of cache " +
                         std::to_string(pin.info().cache_id));
      return Outcome::kRefused;
    }
  }
  WriteGrants::Hold hold;  // the grant stays until the bytes landed (or the write failed)
  std::string why;
  if (pin.info().writes_by_grant &&
      !grants.admit(writer_cluster, grant, pin.info(), ops, &hold, &why)) {
    *refusal = invalid(why);
    return Outcome::kRefused;
  }
  *bytes = total;
  if (source == wire::kFromWriter) {
    // Copied while the pin holds the destination registered and the hold keeps the grant
    // from being revoked (revoke waits for this write); reading the writer's memory cannot
    // harm it.
    Status s = cma_read(static_cast<int>(writer->pid), writer->pidfd.get(), ops,
                        deadline_after_ms(kSameHostCopyLimitMs), copiers, meter);
    if (!s.ok()) {
      *refusal = s;
      return Outcome::kRefused;
    }
    return Outcome::kDone;
  }
  std::vector<iovec> iov(n);
  for (uint32_t i = 0; i < n; ++i) {
    iov[i] = {reinterpret_cast<void*>(ops[i].local), ops[i].len};
  }
  out->reset(new WriteIntake(std::move(pin), std::move(hold), std::move(iov), total, meter));
  return Outcome::kAwaitData;
}

bool WriteIntake::expects(const wire::Header& h) const {
  return h.type == wire::kData && h.length == total_;
}

int WriteIntake::receive(int fd) {
  while (first_ < iov_.size()) {
    msghdr msg{};
    msg.msg_iov = iov_.data() + first_;
    msg.msg_iovlen = std::min<size_t>(iov_.size() - first_, IOV_MAX);
    ssize_t r = ::recvmsg(fd, &msg, MSG_DONTWAIT);
    if (r == 0) return -1;
    if (r < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
    first_ = wire::advance_iov(iov_.data(), iov_.size(), first_, static_cast<size_t>(r));
  }
  return 1;
}

}  // namespace hixl
