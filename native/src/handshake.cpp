#include "handshake.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include "auth.h"

namespace hixl {

Identity local_identity(int64_t cluster_id, const uint8_t* probe, uint64_t unregistrations_addr) {
  Identity id;
  id.cluster_id = cluster_id;
  id.pid = ::getpid();
  struct stat st {};
  if (::stat("/proc/self/ns/pid", &st) == 0) id.pid_namespace = st.st_ino;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::getline(boot, id.boot_id);
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  id.host = host;
  id.probe_addr = reinterpret_cast<uint64_t>(probe);
  std::memcpy(id.probe.data(), probe, kProbeBytes);
  id.unregistrations_addr = unregistrations_addr;
  return id;
}

namespace {

Status link_failed(const std::string& msg) { return Status::Error(status::kLinkFailed, msg); }

Status io_failure(const std::string& what, const wire::IoResult& io) {
  return Status::Error(io.timed_out() ? status::kTimeout : status::kLinkFailed,
                       what + ": " + io.reason);
}

// Receives one frame of the expected type, turning an ERROR frame into its status.
Status expect_frame(int fd, uint16_t type, std::vector<uint8_t>* payload, uint64_t max_payload,
                    Deadline deadline, const std::string& what) {
  wire::Header h;
  wire::IoResult io = wire::recv_frame(fd, &h, payload, max_payload, deadline);
  if (!io.ok()) return io_failure(what, io);
  if (h.type == wire::kError) {
    Status s = wire::decode_error(*payload, what);
    if (s.code != status::kTimeout) s.code = status::kLinkFailed;
    return s;
  }
  if (h.type != type) return link_failed(what + ": unexpected frame type " + std::to_string(h.type));
  return Status::Ok();
}

// The ERROR frame the server sent before it closed the connection, if one is there to read;
// Ok when there is none.
Status pending_refusal(int fd, Deadline deadline, const std::string& what) {
  wire::Header h;
  std::vector<uint8_t> payload;
  if (!wire::recv_frame(fd, &h, &payload, 1024, deadline).ok() || h.type != wire::kError) {
    return Status::Ok();
  }
  Status s = wire::decode_error(payload, what);
  s.code = status::kLinkFailed;
  return s;
}

void refuse(int fd, int64_t code, const std::string& msg, Deadline deadline) {
  wire::send_frame(fd, wire::kError, wire::error_payload(code, msg), deadline);
}

Status client_steps(int fd, int64_t my_cluster, int64_t expected_cluster, uint8_t channel,
                    const std::string& token, Deadline deadline, Identity* peer) {
  const std::string what = "handshake with cluster " + std::to_string(expected_cluster);
  Nonce client_nonce = make_nonce();
  wire::Encoder hello;
  hello.i64(my_cluster);
  hello.i64(expected_cluster);
  hello.u8(channel);
  hello.raw(client_nonce.data(), client_nonce.size());
  wire::IoResult io = wire::send_frame(fd, wire::kHello, hello.bytes(), deadline);
  std::vector<uint8_t> payload;
  if (!io.ok()) {
    // A server that refused us on accept (busy) sent its reason before it closed, and our
    // HELLO drew the reset: the reason is more use to the caller than "connection reset".
    Status refusal = pending_refusal(fd, std::min(deadline, deadline_after_ms(100)), what);
    return refusal.ok() ? io_failure(what, io) : refusal;
  }

  Status s = expect_frame(fd, wire::kChallenge, &payload, 1024, deadline, what);
  if (!s.ok()) return s;
  wire::Decoder dec(payload.data(), payload.size());
  uint8_t server_has_token = 0;
  Nonce server_nonce{};
  Digest proof{};
  if (!dec.u8(&server_has_token) || !dec.raw(server_nonce.data(), server_nonce.size()) ||
      !dec.raw(proof.data(), proof.size()) || dec.remaining() != 0) {
    return link_failed(what + ": malformed challenge");
  }
  if (server_has_token && token.empty()) {
    return link_failed(what + ": authentication failed: the peer requires a token");
  }
  if (!token.empty()) {
    if (!server_has_token) {
      return link_failed(what + ": authentication failed: the peer has no token");
    }
    if (!digests_equal(proof, server_proof(token, client_nonce, server_nonce))) {
      return link_failed(what + ": authentication failed: the peer's token differs");
    }
  }
  Digest mine{};
  if (!token.empty()) mine = client_proof(token, client_nonce, server_nonce);
  std::vector<uint8_t> auth(mine.begin(), mine.end());
  io = wire::send_frame(fd, wire::kAuth, auth, deadline);
  if (!io.ok()) return io_failure(what, io);

  s = expect_frame(fd, wire::kWelcome, &payload, 16384, deadline, what);
  if (!s.ok()) return s;
  wire::Decoder w(payload.data(), payload.size());
  if (!w.i64(&peer->cluster_id) || !w.i64(&peer->pid) || !w.u64(&peer->pid_namespace) ||
      !w.str(&peer->boot_id) || !w.str(&peer->host) || !w.u64(&peer->probe_addr) ||
      !w.raw(peer->probe.data(), peer->probe.size()) || !w.u64(&peer->unregistrations_addr) ||
      w.remaining() != 0) {
    return link_failed(what + ": malformed welcome");
  }
  if (peer->cluster_id != expected_cluster) {
    return link_failed(what + ": the peer is cluster " + std::to_string(peer->cluster_id));
  }
  return Status::Ok();
}

std::string server_steps(int fd, const Identity& me, const std::string& token,
                         Deadline deadline, const Admission& admit, bool* auth_refused) {
  wire::Header h;
  std::vector<uint8_t> payload;
  wire::IoResult io = wire::recv_frame(fd, &h, &payload, 1024, deadline);
  if (!io.ok()) {
    refuse(fd, status::kLinkFailed, "handshake: " + io.reason, deadline);
    return io.reason;
  }
  wire::Decoder dec(payload.data(), payload.size());
  int64_t client_cluster = 0, expected = 0;
  uint8_t channel = 0;
  Nonce client_nonce{};
  if (h.type != wire::kHello || !dec.i64(&client_cluster) || !dec.i64(&expected) ||
      !dec.u8(&channel) || !dec.raw(client_nonce.data(), client_nonce.size()) ||
      dec.remaining() != 0 || channel > wire::kDataChannel) {
    refuse(fd, status::kLinkFailed, "malformed hello", deadline);
    return "malformed hello";
  }
  if (expected != me.cluster_id) {
    std::string why = "this is cluster " + std::to_string(me.cluster_id) + ", not " +
                      std::to_string(expected);
    refuse(fd, status::kLinkFailed, why, deadline);
    return why;
  }
  Nonce server_nonce = make_nonce();
  Digest proof{};
  if (!token.empty()) proof = server_proof(token, client_nonce, server_nonce);
  wire::Encoder challenge;
  challenge.u8(token.empty() ? 0 : 1);
  challenge.raw(server_nonce.data(), server_nonce.size());
  challenge.raw(proof.data(), proof.size());
  io = wire::send_frame(fd, wire::kChallenge, challenge.bytes(), deadline);
  if (!io.ok()) return io.reason;

  io = wire::recv_frame(fd, &h, &payload, 1024, deadline);
  if (!io.ok()) return io.reason;
  Digest client{};
  if (h.type != wire::kAuth || payload.size() != client.size()) {
    *auth_refused = true;
    refuse(fd, status::kLinkFailed, "authentication failed: malformed auth frame", deadline);
    return "malformed auth";
  }
  std::memcpy(client.data(), payload.data(), client.size());
  if (!token.empty() && !digests_equal(client, client_proof(token, client_nonce, server_nonce))) {
    *auth_refused = true;
    refuse(fd, status::kLinkFailed, "authentication failed", deadline);
    return "authentication failed";
  }
  std::string refusal = admit();
  if (!refusal.empty()) {
    refuse(fd, status::kLinkBusy, refusal, deadline);
    return refusal;
  }
  wire::Encoder welcome;
  welcome.i64(me.cluster_id);
  welcome.i64(me.pid);
  welcome.u64(me.pid_namespace);
  welcome.str(me.boot_id);
  welcome.str(me.host);
  welcome.u64(me.probe_addr);
  welcome.raw(me.probe.data(), me.probe.size());
  welcome.u64(me.unregistrations_addr);
  return wire::send_frame(fd, wire::kWelcome, welcome.bytes(), deadline).reason;
}

}  // namespace

Status client_handshake(int fd, int64_t my_cluster, int64_t expected_cluster, uint8_t channel,
                        const std::string& token, Deadline deadline, Identity* peer) {
  // Nonces and proofs throw when the kernel or libcrypto fail; the link fails, not the process.
  try {
    return client_steps(fd, my_cluster, expected_cluster, channel, token, deadline, peer);
  } catch (const std::exception& e) {
    return link_failed("handshake with cluster " + std::to_string(expected_cluster) + ": " +
                       e.what());
  }
}

std::string server_handshake(int fd, const Identity& me, const std::string& token,
                             Deadline deadline, const Admission& admit, bool* auth_refused) {
  *auth_refused = false;
  // Runs on a connection thread, where an escaping exception would end the process.
  try {
    return server_steps(fd, me, token, deadline, admit, auth_refused);
  } catch (const std::exception& e) {
    std::string why = std::string("handshake: internal error: ") + e.what();
    refuse(fd, status::kFailed, why, deadline);
    return why;
  }
}

}  // namespace hixl
