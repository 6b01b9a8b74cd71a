"""CPU-only speedups: C kernels built on first use (`native`), oneDNN-packed linears (`packed_linear`)."""
