"""Turning logits into tokens: the seeded stream, the sampler, logprobs, and constraints."""
