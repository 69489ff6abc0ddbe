// SHA-256, HMAC-SHA256 and constant-time comparison, delegated to OpenSSL's libcrypto: link
// authentication should rest on a maintained, audited implementation.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace hixl {

using Digest = std::array<uint8_t, 32>;

// Both throw std::runtime_error when libcrypto fails (in practice: out of memory).
Digest sha256(const void* data, size_t len);
Digest hmac_sha256(const std::string& key, const void* data, size_t len);

// Constant-time comparison so timing does not leak how many bytes matched.
bool digests_equal(const Digest& a, const Digest& b);

}  // namespace hixl
