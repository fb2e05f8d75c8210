"""Layer kernels: how a linear layer, attention or a norm computes (int8, fp32 rows, packed fp32, exact attention)."""
