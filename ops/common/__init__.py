"""Plumbing every op family shares: ``op`` (``kiln_op``, the one way to define an op, and the
``DIRECT`` table the runtime calls), ``launch`` (when to launch Triton, device properties, PDL and
pre-wait switches, arrival counters) and ``quant`` (FP8 constants and quantization helpers, in
torch and in Triton, also used by ``kiln.weights``)."""
