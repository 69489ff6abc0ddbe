#include "common/auth.h"

#include <cstring>
#include <vector>

#include "common/wire.h"

namespace hixl {
namespace {

Digest proof(const std::string& token, const char* label, const Nonce& first,
             const Nonce& second) {
  std::vector<uint8_t> msg(label, label + std::strlen(label));
  msg.insert(msg.end(), first.begin(), first.end());
  msg.insert(msg.end(), second.begin(), second.end());
  return hmac_sha256(token, msg.data(), msg.size());
}

}  // namespace

std::string token_problem(const std::string& token) {
  if (token.empty() || token.size() >= kMinTokenChars) return "";
  return "auth token must be at least " + std::to_string(kMinTokenChars) +
         " characters (got " + std::to_string(token.size()) +
         "); generate one with `python -c 'import secrets; print(secrets.token_hex(32))'`";
}

Nonce make_nonce() {
  Nonce n{};
  wire::fill_random(n.data(), n.size());
  return n;
}

Digest server_proof(const std::string& token, const Nonce& client_nonce,
                    const Nonce& server_nonce) {
  return proof(token, "hixl-server-v1", client_nonce, server_nonce);
}

Digest client_proof(const std::string& token, const Nonce& client_nonce,
                    const Nonce& server_nonce) {
  return proof(token, "hixl-client-v1", server_nonce, client_nonce);
}

}  // namespace hixl
