#include "server/admissions.h"

namespace hixl {

bool Admissions::enter_handshake() {
  std::lock_guard<std::mutex> lock(mu_);
  if (handshaking_ >= max_handshaking_) return false;
  handshaking_++;
  return true;
}

bool Admissions::connections_full() const {
  std::lock_guard<std::mutex> lock(mu_);
  return authenticated_ >= max_connections_;
}

bool Admissions::promote() {
  std::lock_guard<std::mutex> lock(mu_);
  if (authenticated_ >= max_connections_) return false;
  handshaking_--;
  authenticated_++;
  return true;
}

void Admissions::leave(bool authenticated) {
  std::lock_guard<std::mutex> lock(mu_);
  (authenticated ? authenticated_ : handshaking_)--;
}

}  // namespace hixl
