#include "common/handshake.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include "common/auth.h"

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
    // A server at a cap says busy (try again later), distinct from a failed link.
    if (s.code != status::kTimeout && s.code != status::kLinkBusy) s.code = status::kLinkFailed;
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
  if (s.code != status::kLinkBusy) s.code = status::kLinkFailed;
  return s;
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

}  // namespace

bool ServerHandshake::on_hello(const Identity& me, const std::string& token,
                               const wire::Header& h, const std::vector<uint8_t>& payload,
                               std::vector<uint8_t>* challenge, std::string* why) {
  wire::Decoder dec(payload.data(), payload.size());
  int64_t client_cluster = 0, expected = 0;
  uint8_t channel = 0;
  if (h.type != wire::kHello || !dec.i64(&client_cluster) || !dec.i64(&expected) ||
      !dec.u8(&channel) || !dec.raw(client_nonce_.data(), client_nonce_.size()) ||
      dec.remaining() != 0 || channel > wire::kDataChannel) {
    *why = "malformed hello";
    return false;
  }
  if (expected != me.cluster_id) {
    *why = "this is cluster " + std::to_string(me.cluster_id) + ", not " + std::to_string(expected);
    return false;
  }
  client_cluster_ = client_cluster;
  channel_ = channel;
  server_nonce_ = make_nonce();
  Digest proof{};
  if (!token.empty()) proof = server_proof(token, client_nonce_, server_nonce_);
  wire::Encoder enc;
  enc.u8(token.empty() ? 0 : 1);
  enc.raw(server_nonce_.data(), server_nonce_.size());
  enc.raw(proof.data(), proof.size());
  *challenge = std::move(enc.bytes());
  return true;
}

bool ServerHandshake::on_auth(const std::string& token, const wire::Header& h,
                              const std::vector<uint8_t>& payload, std::string* why) const {
  Digest client{};
  if (h.type != wire::kAuth || payload.size() != client.size()) {
    *why = "authentication failed: malformed auth frame";
    return false;
  }
  std::memcpy(client.data(), payload.data(), client.size());
  if (!token.empty() && !digests_equal(client, client_proof(token, client_nonce_, server_nonce_))) {
    *why = "authentication failed";
    return false;
  }
  return true;
}

std::vector<uint8_t> welcome_payload(const Identity& me) {
  wire::Encoder welcome;
  welcome.i64(me.cluster_id);
  welcome.i64(me.pid);
  welcome.u64(me.pid_namespace);
  welcome.str(me.boot_id);
  welcome.str(me.host);
  welcome.u64(me.probe_addr);
  welcome.raw(me.probe.data(), me.probe.size());
  welcome.u64(me.unregistrations_addr);
  return std::move(welcome.bytes());
}


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

}  // namespace hixl
