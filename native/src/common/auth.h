// Shared-secret challenge/response: each side proves knowledge of the token with an
// HMAC-SHA256 over both nonces, labelled by direction so a proof cannot be reflected.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "common/crypto.h"

namespace hixl {

using Nonce = std::array<uint8_t, 32>;

// Shortest accepted token: 32 characters, e.g. 16 random bytes in hex (128 bits), so the
// HMAC proofs cannot be brute-forced offline from one captured handshake.
constexpr size_t kMinTokenChars = 32;

// "" when the token is acceptable (empty = authentication off, or >= kMinTokenChars
// characters), else the reason to show the user.
std::string token_problem(const std::string& token);

// Fresh random bytes; throws std::system_error when the kernel cannot supply them.
Nonce make_nonce();
Digest server_proof(const std::string& token, const Nonce& client_nonce,
                    const Nonce& server_nonce);
Digest client_proof(const std::string& token, const Nonce& client_nonce,
                    const Nonce& server_nonce);

}  // namespace hixl
