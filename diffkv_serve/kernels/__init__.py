"""Triton kernels, each beside a plain-torch reference of the same function (used on CPU and in tests)."""
