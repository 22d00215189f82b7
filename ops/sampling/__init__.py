"""Sampling kernels: greedy argmax and seeded Gumbel-max sampling over the vocabulary (``gumbel``)."""
