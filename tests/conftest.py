import os

# Triton kernels run on CPU tensors through Triton's interpreter; it must be chosen before triton is imported.
if not os.environ.get("DIFFKV_TEST_DEVICE", "cpu").startswith("cuda"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
