"""Random token trees for kernel and cache tests, and their ``TreeMask`` encoding.

The encoding is computed here independently of the core's planner, so a test that feeds it to a
kernel does not share a bug with the code that builds masks for real forwards.
"""

from __future__ import annotations

import numpy as np


def random_parents(rng: np.random.Generator, size: int, new_root: float = 0.15) -> list:
    """Parents of a random forest of ``size`` nodes, each parent before its child: node 0, and
    any later node with probability ``new_root``, is a root (-1); the others pick an earlier node."""
    return [-1 if i == 0 or rng.random() < new_root else int(rng.integers(0, i))
            for i in range(size)]


def tree_mask(parents) -> np.ndarray:
    """The ``TreeMask.mask`` of one forest: ``(order, upper)`` of every node, interleaved, int32
    of shape (2 * len(parents),). ``order`` numbers the nodes in a depth-first walk (roots and
    children in index order); ``upper`` is ``order`` plus the node's subtree size, so key node
    ``m`` is visible to query node ``n`` iff ``order[m] <= order[n] < upper[m]``."""
    n = len(parents)
    children: list = [[] for _ in range(n)]
    roots: list = []
    for node, parent in enumerate(parents):
        (roots if parent < 0 else children[parent]).append(node)
    order, upper = np.zeros(n, np.int32), np.zeros(n, np.int32)
    walked = 0
    stack = [(root, False) for root in reversed(roots)]
    while stack:
        node, leaving = stack.pop()
        if leaving:
            upper[node] = walked
            continue
        order[node] = walked
        walked += 1
        stack.append((node, True))
        stack.extend((child, False) for child in reversed(children[node]))
    return np.stack([order, upper], axis=1).reshape(-1)


def random_tree(rng: np.random.Generator, size: int) -> np.ndarray:
    """``tree_mask`` of a random forest of ``size`` nodes (see ``random_parents``)."""
    return tree_mask(random_parents(rng, size))
