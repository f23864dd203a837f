"""The prefix cache in the scheduler fuzzing machine (:mod:`.machine`): invariant 7 after every
rule, and the teardown's last word on it.

With the cache on, pages at quiescence are not all free: the radix tree keeps what it cached.
They are not leaked as long as nobody locks them; :func:`drain_prefix_cache` checks that, then
evicts the whole tree, so the machine's "every page is free again" check holds as without the
cache. Each check raises :class:`~scheduler.testing.verdicts.InvariantViolation` naming
invariant 7.
"""

from __future__ import annotations

from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.testing.verdicts import invariant


def check_prefix_cache(sched: PrefillScheduler) -> None:
    """Invariant 7: every page free, or the tree's, or one live request's own; lock counts equal
    the requests using each node; no tree page free (so eviction freed nothing in use)."""
    with invariant(7):
        problems = sched.prefix_violations()
        assert not problems, "; ".join(problems)


def drain_prefix_cache(sched: PrefillScheduler) -> None:
    """At quiescence: nothing in the tree is locked any more; then evict all of it."""
    prefix = sched.prefix
    if prefix is None:
        return
    tree = prefix.tree
    with invariant(7):
        assert tree.violations([]) == [], tree.violations([])
        assert tree.evictable == tree.size, (
            f"{tree.size - tree.evictable} tree pages stay locked after every request ended")
        size = tree.size
        assert tree.evict(size) == size and tree.size == 0, "the tree did not evict everything"
