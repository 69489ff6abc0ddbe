// Connection handshake: HELLO -> CHALLENGE -> AUTH -> WELCOME (or ERROR and close).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>

#include "hixl/engine.h"
#include "wire.h"

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

// Called once the client proved the token, before WELCOME: "" admits the connection, any
// other text is sent as a LINK_BUSY refusal in place of WELCOME.
using Admission = std::function<std::string()>;

// Server side: "" on success, else the reason; an error frame was already sent.
// *auth_refused is set when the client failed authentication.
std::string server_handshake(int fd, const Identity& me, const std::string& token,
                             Deadline deadline, const Admission& admit, bool* auth_refused);

}  // namespace hixl
