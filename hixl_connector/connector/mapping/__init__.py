"""Pure planning: which blocks, heads and bytes of P go where on D. No I/O."""
