// Argument conversion shared by the nanobind modules.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>
#include <vector>

namespace hixl_bindings {

namespace nb = nanobind;

template <typename Elem, typename Out>
inline bool copy_array(nb::handle h, std::vector<Out>* out) {
  nb::ndarray<const Elem, nb::ndim<1>, nb::device::cpu> a;
  if (!nb::try_cast(h, a, false)) return false;
  out->resize(a.shape(0));
  const Elem* data = a.data();
  const int64_t stride = a.stride(0);
  for (size_t i = 0; i < out->size(); ++i) {
    (*out)[i] = static_cast<Out>(data[static_cast<int64_t>(i) * stride]);
  }
  return true;
}

// Accepts a 1-D int64/uint64 numpy array (no per-element Python work) or any int sequence.
template <typename Out>
std::vector<Out> to_vector(nb::handle h, const char* name) {
  std::vector<Out> out;
  if (nb::ndarray_check(h) &&
      (copy_array<int64_t>(h, &out) || copy_array<uint64_t>(h, &out))) {
    return out;
  }
  if (!nb::isinstance<nb::sequence>(h) || nb::isinstance<nb::str>(h)) {
    throw nb::type_error(
        (std::string(name) + " must be a sequence of int or a 1-D int64/uint64 array").c_str());
  }
  nb::sequence seq = nb::borrow<nb::sequence>(h);
  out.reserve(nb::len(seq));
  for (nb::handle item : seq) {
    Out v;
    if (!nb::try_cast(item, v)) {
      throw nb::type_error((std::string(name) + " holds a non-integer or out-of-range value")
                               .c_str());
    }
    out.push_back(v);
  }
  return out;
}

}  // namespace hixl_bindings
