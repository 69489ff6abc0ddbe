#include "common/crypto.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <stdexcept>

namespace hixl {

Digest sha256(const void* data, size_t len) {
  Digest out{};
  unsigned int out_len = 0;
  if (EVP_Digest(data, len, out.data(), &out_len, EVP_sha256(), nullptr) != 1 ||
      out_len != out.size()) {
    throw std::runtime_error("libcrypto: SHA-256 failed");
  }
  return out;
}

Digest hmac_sha256(const std::string& key, const void* data, size_t len) {
  Digest out{};
  unsigned int out_len = 0;
  // HMAC() hashes a key longer than the block size first, as RFC 2104 requires.
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           static_cast<const unsigned char*>(data), len, out.data(), &out_len) == nullptr ||
      out_len != out.size()) {
    throw std::runtime_error("libcrypto: HMAC-SHA256 failed");
  }
  return out;
}

bool digests_equal(const Digest& a, const Digest& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace hixl
