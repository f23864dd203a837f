"""The seeded stream: the uniform number each output position of a request draws.

A request's output is sampled on two machines: the prefill side draws output position 0, the
decode peer positions 1, 2, ... So the stream is *counter-based*: the draw of position ``i`` is
a pure function of the request's seed and ``i`` (splitmix64 of both, 53 bits), and needs no
state carried from one side to the other. The same seed gives the same draws on every run,
disaggregated or colocated, whatever the batching.

A request's seed is ``SamplingParams.seed`` when the client gave one, else its bootstrap room,
which both sides of a PD pair share (a request without a seed is still reproducible from its
room, but rooms are the router's to choose).
"""

from __future__ import annotations

from lifecycle import SamplingParams

_MASK64 = (1 << 64) - 1
# The golden-ratio increment of splitmix64.
_GAMMA = 0x9E3779B97F4A7C15


def splitmix64(x: int) -> int:
    """The splitmix64 output function of ``x`` (a 64-bit bijection with good avalanche)."""
    z = (x + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """Output position ``position``'s draw for ``seed``: a float in ``[0, 1)`` with 53 random
    bits."""
    if not 0 <= seed <= _MASK64 or position < 0:
        raise ValueError(f"seed must be in 0 .. 2**64 - 1 and position >= 0, got {seed}, "
                         f"{position}")
    z = splitmix64(splitmix64(seed) ^ (position & _MASK64))
    return (z >> 11) * 2.0**-53


def request_seed(sampling: SamplingParams, bootstrap_room: int) -> int:
    """The seed of a request's stream: its own, else its bootstrap room."""
    return bootstrap_room if sampling.seed is None else sampling.seed
