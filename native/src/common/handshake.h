// Connection handshake: HELLO -> CHALLENGE -> AUTH -> WELCOME (or ERROR and close).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "hixl/engine.h"
#include "common/wire.h"

namespace hixl {

constexpr size_t kProbeBytes = 16;

struct Identity {
  int64_t cluster_id = 0;
  int64_t pid = 0;
  uint64_t pid_namespace = 0;
  std::string boot_id;
  std::string host;
  uint64_t probe_addr = 0;
  std::array<uint8_t, kProbeBytes> probe{};
  uint64_t unregistrations_addr = 0;  // where same-host peers read the table's unregistration count
};

Identity local_identity(int64_t cluster_id, const uint8_t* probe, uint64_t unregistrations_addr);

// Client side. expected_cluster is the cluster id the caller wants to reach.
Status client_handshake(int fd, int64_t my_cluster, int64_t expected_cluster, uint8_t channel,
                        const std::string& token, Deadline deadline, Identity* peer);

// Server side, a frame at a time: the serving loop does the I/O (HELLO -> CHALLENGE,
// AUTH -> WELCOME). A step that fails sets *why, which goes to the client in an ERROR frame.
class ServerHandshake {
 public:
  // Checks HELLO and fills the CHALLENGE payload; throws std::system_error when the kernel
  // has no randomness for the nonce.
  bool on_hello(const Identity& me, const std::string& token, const wire::Header& h,
                const std::vector<uint8_t>& payload, std::vector<uint8_t>* challenge,
                std::string* why);
  // True when the client proved the token (or neither side has one).
  bool on_auth(const std::string& token, const wire::Header& h,
               const std::vector<uint8_t>& payload, std::string* why) const;
  // What the client's HELLO said: its cluster and which channel this connection is.
  int64_t client_cluster() const { return client_cluster_; }
  bool control_channel() const { return channel_ == wire::kControlChannel; }

 private:
  int64_t client_cluster_ = 0;
  uint8_t channel_ = 0;
  std::array<uint8_t, 32> client_nonce_{};
  std::array<uint8_t, 32> server_nonce_{};
};

std::vector<uint8_t> welcome_payload(const Identity& me);

}  // namespace hixl
