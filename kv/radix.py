"""The prefix cache: a radix tree over token ids whose nodes own KV pages.

Theory of operation
-------------------
The tree works in whole pages. A node's ``key`` is a run of token ids, a multiple of the page
size long, and its ``pages`` hold their K/V (page ``i`` of a node holds tokens
``key[i*ps:(i+1)*ps]``). The path from the root to a node spells a prompt prefix; the pages along
it are that prefix's page table. Children are keyed by their first page of tokens, so two
children of one node never start with the same page.

- :meth:`RadixCache.match` walks the tree along a prompt and returns the longest cached prefix
  (whole pages). When the match ends inside a node, the node is split there, so every match ends
  on a node: the one a request locks.
- :meth:`RadixCache.insert` walks the same way with a request's computed pages. Where the tree
  already holds a page for a position, the caller's page there is a duplicate and stays the
  caller's; past the end of the tree a new leaf *adopts* the caller's remaining pages: from then
  on the tree owns them. :meth:`RadixCache.extend` adds a leaf under a known node, the way a
  request caches its next pages below the path it holds.
- :meth:`RadixCache.lock` counts one more user of a node and of every node above it (a request
  uses its whole path); :meth:`RadixCache.unlock` undoes it. A node with a lock count above zero
  is never evicted.
- :meth:`RadixCache.evict` frees the pages of least-recently-used unlocked leaves until enough
  pages are free; a parent left childless and unlocked becomes a leaf that can go next. The
  leaves wait in a heap keyed by recency that names a node at most once: a use does not queue
  the node again, and an entry whose node was used since it was queued goes back in at the
  node's recency when it comes up. So the heap never outgrows the tree, however often a prompt
  is matched between evictions (a request waiting for pages is matched on every pass).

Ownership (docs/prefix-cache.md): a page is free (the allocator's), or the tree's, or held by
exactly one request that has not inserted it. The tree frees only its own unlocked pages, and
only through :meth:`RadixCache.evict`. :class:`PrefixHold` is what one request holds of the
tree: the node it locks and the pages of its page table that belong to the tree.

Recency is a counter, not a clock, so eviction order is deterministic. Nothing here is
thread-safe: the scheduler's one loop thread owns the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator, Sequence

import attrs

from kv.pool import PageAllocator


class RadixError(Exception):
    """The tree was used against its contract: an unlock without a lock, a key that is not
    whole pages, pages that do not match their tokens."""


class Node:
    """One node: ``key`` (whole pages of tokens) and the ``pages`` holding their K/V."""

    __slots__ = ("children", "end", "key", "last_access", "lock_ref", "pages", "parent", "queued",
                 "serial")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: Node | None,
                 end: int, serial: int) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.end = end  # pages from the root to the end of this node
        self.lock_ref = 0
        self.last_access = 0
        self.serial = serial
        self.queued = False  # an entry of the eviction queue names this node

    def __repr__(self) -> str:
        return (f"Node(#{self.serial}, pages={self.pages}, end={self.end}, "
                f"lock_ref={self.lock_ref})")

    def path(self) -> Iterator[Node]:
        """This node and its ancestors up to (not including) the root."""
        node: Node | None = self
        while node is not None and node.parent is not None:
            yield node
            node = node.parent


@attrs.frozen
class Match:
    """The longest cached prefix of a prompt: ``pages`` (its page table), the ``node`` it ends
    on, and ``unlocked``: how many pages of the path nobody locks now, which stop being
    evictable once this match is locked. A lock covers a node's whole path, so those are the
    deepest pages: :attr:`unlocked_pages`."""

    node: Node
    pages: tuple[int, ...]
    unlocked: int

    @property
    def unlocked_pages(self) -> tuple[int, ...]:
        """The pages of the path nobody locks now (the last ``unlocked`` of ``pages``)."""
        return self.pages[len(self.pages) - self.unlocked :]


@attrs.frozen
class Inserted:
    """What :meth:`RadixCache.insert` did: the ``node`` the inserted prefix ends on, and the
    caller's pages the tree ``adopted`` (the tree owns them now)."""

    node: Node
    adopted: tuple[int, ...]


class RadixCache:
    """A radix tree of cached prompt prefixes over the pages of ``allocator``."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._serials = itertools.count(1)
        self.root = Node((), [], None, 0, 0)
        self._clock = 0
        self._size = 0  # pages in the tree
        self._evictable = 0  # pages in nodes whose lock count is 0
        # The eviction queue: (last_access when queued, serial, node), at most one per node.
        self._leaves: list[tuple[int, int, Node]] = []

    # -- sizes ------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Pages the tree owns."""
        return self._size

    @property
    def evictable(self) -> int:
        """Pages of unlocked nodes: what :meth:`evict` could free."""
        return self._evictable

    def pages(self) -> Iterator[int]:
        """Every page the tree owns."""
        for node in self._nodes():
            yield from node.pages

    # -- match and insert --------------------------------------------------------------------

    def match(self, tokens: Sequence[int], max_pages: int | None = None) -> Match:
        """The longest cached prefix of ``tokens`` in whole pages (at most ``max_pages``)."""
        ps = self.page_size
        limit = len(tokens) // ps if max_pages is None else min(max_pages, len(tokens) // ps)
        node, at, pages = self.root, 0, []
        while at < limit:
            child = node.children.get(tuple(tokens[at * ps : (at + 1) * ps]))
            if child is None:
                break
            k = self._common_pages(child, tokens, at, limit)
            if k < len(child.pages):
                child = self._split(child, k)
            # A partial match split the child: the next page differs (or the limit is
            # reached), so the walk ends on the upper part.
            pages += child.pages
            node, at = child, at + k
        self._touch(node)
        unlocked = sum(len(n.pages) for n in node.path() if n.lock_ref == 0)
        return Match(node, tuple(pages), unlocked)

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> Inserted:
        """Cache ``pages`` as the K/V of ``tokens`` (exactly ``len(pages)`` whole pages).

        Positions the tree already holds keep the tree's pages (the caller's are duplicates and
        stay the caller's); the rest become a new leaf that adopts the caller's pages."""
        ps = self.page_size
        if len(tokens) != len(pages) * ps:
            raise RadixError(f"{len(tokens)} tokens are not {len(pages)} whole pages of {ps}")
        node, at = self.root, 0
        while at < len(pages):
            child = node.children.get(tuple(tokens[at * ps : (at + 1) * ps]))
            if child is None:
                break
            k = self._common_pages(child, tokens, at, len(pages))
            if k < len(child.pages):
                child = self._split(child, k)
            node, at = child, at + k
        adopted = tuple(pages[at:])
        if adopted:
            key = tuple(tokens[at * ps :])
            leaf = Node(key, list(adopted), node, node.end + len(adopted), next(self._serials))
            node.children[key[:ps]] = leaf
            self._size += len(adopted)
            self._evictable += len(adopted)
            node = leaf
        self._touch(node)
        return Inserted(node, adopted)

    def extend(self, node: Node, tokens: Sequence[int], pages: Sequence[int]) -> Node | None:
        """Cache ``pages`` (whole pages of ``tokens``, which continue ``node``'s path) as a new
        leaf under ``node`` and return it; or None, adopting nothing, when ``node`` already has a
        child for the first page of ``tokens``: someone cached the same continuation first, and
        the caller's pages are duplicates that stay the caller's."""
        ps = self.page_size
        if not pages or len(tokens) != len(pages) * ps:
            raise RadixError(f"{len(tokens)} tokens are not {len(pages)} (> 0) whole pages")
        if node is not self.root and node.parent is None:
            raise RadixError(f"extend() under {node!r}, which was evicted")
        key = tuple(tokens)
        if key[:ps] in node.children:
            return None
        leaf = Node(key, list(pages), node, node.end + len(pages), next(self._serials))
        node.children[key[:ps]] = leaf
        self._size += len(pages)
        self._evictable += len(pages)
        self._touch(leaf)
        return leaf

    def _common_pages(self, child: Node, tokens: Sequence[int], at: int, limit: int) -> int:
        """How many of ``child``'s pages match ``tokens`` from page ``at`` (at most up to page
        ``limit``); at least 1, since the child was found by its first page."""
        ps = self.page_size
        n = min(len(child.pages), limit - at)
        if child.key[: n * ps] == tuple(tokens[at * ps : (at + n) * ps]):
            return n
        k = 1
        while k < n and child.key[k * ps : (k + 1) * ps] == tuple(
            tokens[(at + k) * ps : (at + k + 1) * ps]
        ):
            k += 1
        return k

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after its first ``k`` pages; return the new upper part. ``node`` keeps
        its identity as the lower part, so a lock held on it still names the same path end."""
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < k < len(node.pages)
        upper = Node(node.key[: k * ps], node.pages[:k], parent, node.end - len(node.pages) + k,
                     next(self._serials))
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        parent.children[upper.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[k * ps :], node.pages[k:], upper
        upper.children[node.key[:ps]] = node
        return upper

    # -- locks -------------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """One more user of ``node``'s path: none of it is evicted until :meth:`unlock`."""
        for n in node.path():
            if n.lock_ref == 0:
                self._evictable -= len(n.pages)
            n.lock_ref += 1

    def unlock(self, node: Node) -> None:
        """One user fewer of ``node``'s path."""
        for n in node.path():
            if n.lock_ref <= 0:
                raise RadixError(f"{n!r} unlocked more often than locked")
        for n in node.path():
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable += len(n.pages)
                self._candidate(n)

    # -- eviction ----------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Free least-recently-used unlocked leaves until ``num_pages`` pages were freed or
        nothing unlocked is left; the pages freed (whole leaves: may exceed the ask)."""
        freed = 0
        while freed < num_pages and self._leaves:
            stamp, _serial, node = heapq.heappop(self._leaves)
            node.queued = False
            if not self._evictable_leaf(node):
                continue
            if node.last_access != stamp:
                # Used since it was queued: back in the queue at its recency. Recency only
                # grows, so every entry's stamp is at most its node's recency, and an entry
                # whose stamp is current is the least recently used of all.
                self._candidate(node)
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[: self.page_size]]
            node.parent = None
            self.allocator.free(node.pages)
            freed += len(node.pages)
            self._size -= len(node.pages)
            self._evictable -= len(node.pages)
            self._candidate(parent)
        return freed

    def _evictable_leaf(self, node: Node) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0

    def _candidate(self, node: Node) -> None:
        """``node`` may have become an unlocked leaf: queue it for eviction, unless an entry
        names it already (:meth:`evict` requeues an entry whose node was used since)."""
        if not node.queued and self._evictable_leaf(node):
            node.queued = True
            heapq.heappush(self._leaves, (node.last_access, node.serial, node))

    def _touch(self, node: Node) -> None:
        """``node``'s path was used now (recency for eviction)."""
        self._clock += 1
        for n in node.path():
            n.last_access = self._clock
        self._candidate(node)

    # -- checks ------------------------------------------------------------------------------

    def _nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def violations(self, holders: Iterable[Node]) -> list[str]:
        """How the tree breaks its invariants, given the nodes its users lock (one entry per
        user): each node's lock count equals the users at or below it; sizes add up; keys are
        whole pages under the right child key; no page twice; no tree page free; the eviction
        queue names every unlocked leaf, and no node twice or outside the tree."""
        out: list[str] = []
        users: dict[int, int] = {}
        for holder in holders:
            if holder is not self.root and holder.parent is None:
                out.append(f"a user locks {holder!r}, which is no longer in the tree")
            for n in holder.path():
                users[id(n)] = users.get(id(n), 0) + 1
        size = evictable = queued = 0
        seen: set[int] = set()
        ps = self.page_size
        for node in self._nodes():
            size += len(node.pages)
            evictable += len(node.pages) if node.lock_ref == 0 else 0
            queued += node.queued
            if self._evictable_leaf(node) and not node.queued:
                out.append(f"{node!r}: an unlocked leaf the eviction queue does not name")
            if node.lock_ref != users.get(id(node), 0):
                out.append(f"{node!r}: lock count {node.lock_ref}, "
                           f"{users.get(id(node), 0)} users")
            assert node.parent is not None
            if not node.pages or len(node.key) != len(node.pages) * ps:
                out.append(f"{node!r}: key of {len(node.key)} tokens for {len(node.pages)} pages")
            if node.parent.children.get(node.key[:ps]) is not node:
                out.append(f"{node!r}: not filed under its first page in its parent")
            if node.end != node.parent.end + len(node.pages):
                out.append(f"{node!r}: ends at page {node.end}, its parent at {node.parent.end}")
            for p in node.pages:
                if p in seen:
                    out.append(f"page {p} is in the tree twice")
                seen.add(p)
        free = set(seen) - set(self.allocator.held_pages())
        if free:
            out.append(f"tree pages {sorted(free)} are free")
        if (size, evictable) != (self._size, self._evictable):
            out.append(f"counted size {self._size} / evictable {self._evictable}, "
                       f"the nodes hold {size} / {evictable}")
        if len(self._leaves) != queued:
            out.append(f"the eviction queue holds {len(self._leaves)} entries for {queued} "
                       "queued nodes of the tree")
        return out


class PrefixHold:
    """What one request holds of a :class:`RadixCache`: a lock on ``node``, the end of its
    cached path, whose pages are the first ``node.end`` pages of its page table (``shared``).
    Every other page of its page table is the request's own, freed when it is released.

    The path grows as the request caches its computed pages below it (:meth:`insert`), until
    it meets pages someone else cached for the same tokens first. From there on the request
    keeps its pages as its own and caches nothing more (``diverged``): it never locks a path
    that is not its page table, so it never pins more pages than its prompt needs (a request
    that needs the whole pool still gets it)."""

    def __init__(self, cache: RadixCache, match: Match | None = None) -> None:
        self.cache = cache
        self.node: Node | None = cache.root if match is None else match.node
        self.shared: set[int] = set() if match is None else set(match.pages)
        self.diverged = False
        cache.lock(self.node)

    def __repr__(self) -> str:
        return f"PrefixHold({self.node!r}, shared={len(self.shared)} pages)"

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Cache the request's computed whole pages (``pages`` is its page table so far,
        ``tokens`` their tokens) below its path and move the lock to the new end. Returns how
        many pages the tree adopted (0 once diverged)."""
        node = self.node
        if node is None:
            raise RadixError("insert() after release()")
        ps, end = self.cache.page_size, node.end
        if self.diverged or len(pages) <= end:
            return 0
        leaf = self.cache.extend(node, tokens[end * ps : len(pages) * ps], pages[end:])
        if leaf is None:
            self.diverged = True
            return 0
        self.cache.lock(leaf)  # lock the new end before letting go of the old one
        self.cache.unlock(node)
        self.node = leaf
        self.shared.update(leaf.pages)
        return len(leaf.pages)

    def own(self, pages: Sequence[int]) -> list[int]:
        """The pages of the page table ``pages`` that are the request's, not the tree's."""
        return [p for p in pages if p not in self.shared]

    def release(self) -> None:
        """Unlock the request's path, once (its pages are no longer read or written)."""
        if self.node is None:
            raise RadixError("a prefix hold released twice")
        self.cache.unlock(self.node)
        self.node = None
