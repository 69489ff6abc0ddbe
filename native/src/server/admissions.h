#pragma once

#include <mutex>

namespace hixl {

// The two pools of a server's connections and their caps: connections in the handshake
// (what a host without the token can hold) and authenticated ones (real links). Shared by a
// server's loops; each cap counts the connections it protects the server from.
class Admissions {
 public:
  Admissions(int max_handshaking, int max_connections)
      : max_handshaking_(max_handshaking), max_connections_(max_connections) {}
  int max_handshaking() const { return max_handshaking_; }
  int max_connections() const { return max_connections_; }
  bool enter_handshake();
  bool connections_full() const;
  // Moves a connection that proved the token to the authenticated pool; false when full.
  bool promote();
  void leave(bool authenticated);

 private:
  const int max_handshaking_;
  const int max_connections_;
  mutable std::mutex mu_;
  int handshaking_ = 0;
  int authenticated_ = 0;
};

}  // namespace hixl
