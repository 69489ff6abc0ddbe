// Minimal SHA-256 and HMAC-SHA256 (FIPS 180-4, RFC 2104), used only for link authentication.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace hixl {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t len);
  Digest finish();

 private:
  void compress(const uint8_t* block);
  uint32_t state_[8];
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
};

Digest sha256(const void* data, size_t len);
Digest hmac_sha256(const std::string& key, const void* data, size_t len);

}  // namespace hixl
