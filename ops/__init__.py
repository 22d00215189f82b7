"""Fused kernels. One file per op: a torch reference, the Triton kernel(s) and a ``torch.library``
op (namespace ``kiln``) whose CUDA implementation launches the kernel and whose CPU
implementation is the reference."""
