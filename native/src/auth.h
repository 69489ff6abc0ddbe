// Shared-secret challenge/response: each side proves knowledge of the token with an
// HMAC-SHA256 over both nonces, labelled by direction so a proof cannot be reflected.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "sha256.h"

namespace hixl {

using Nonce = std::array<uint8_t, 32>;

Nonce make_nonce();
Digest server_proof(const std::string& token, const Nonce& client_nonce,
                    const Nonce& server_nonce);
Digest client_proof(const std::string& token, const Nonce& client_nonce,
                    const Nonce& server_nonce);
// Constant-time comparison so timing does not leak how many bytes matched.
bool digests_equal(const Digest& a, const Digest& b);

}  // namespace hixl
