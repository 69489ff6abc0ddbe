namespace hixl {
int engine_abi_version() { return 0; }
}  // namespace hixl
