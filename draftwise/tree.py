"""Draft trees: a draft is a list of nodes, each a token with the index of its parent node.

Parent -1 is the last committed token (the root, row 0 of a verify forward); node i is row
1 + i. Parents always precede their children, so the first m nodes of a tree are a tree too
(trimming needs no re-indexing). A chain is the tree whose node i has parent i - 1.
"""

from __future__ import annotations

import torch


def chain_parents(num_nodes: int) -> torch.Tensor:
    """The parents of a chain of num_nodes tokens: -1, 0, 1, ... -> [n]."""
    return torch.arange(-1, num_nodes - 1)


def is_chain(parents: torch.Tensor) -> bool:
    return bool(torch.equal(parents, chain_parents(parents.shape[0])))


def check_parents(parents: torch.Tensor) -> None:
    """Refuse a parents vector that is not a tree in topological order (a drafter's bug)."""
    indices = torch.arange(parents.shape[0])
    if parents.dim() != 1 or bool(((parents < -1) | (parents >= indices)).any()):
        raise ValueError(f"draft parents must satisfy -1 <= parents[i] < i, got {parents.tolist()}")


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each node, 1 for a child of the root -> [n]."""
    result = torch.zeros(parents.shape[0], dtype=torch.long)
    for node, parent in enumerate(parents.tolist()):  # parents precede children: one pass
        result[node] = 1 if parent < 0 else int(result[parent]) + 1
    return result


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[1 + n, 1 + n] bool over the root and the nodes: row r may attend to column c when c is r
    itself or one of its ancestors (the tree attention mask of a verify forward)."""
    num_rows = parents.shape[0] + 1
    mask = torch.zeros(num_rows, num_rows, dtype=torch.bool)
    mask[0, 0] = True
    for node, parent in enumerate(parents.tolist()):
        row = node + 1
        mask[row] = mask[parent + 1]  # the parent's ancestors (the root's row for parent -1)
        mask[row, row] = True
    return mask


def path_mask(rows: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """[rows, rows - 1] bool: which draft nodes lie on each verify row's path (row 0 the last
    committed token's, row r > 0 node r - 1's): a tree's ancestor mask (ancestor_mask) without
    its root column, or for a chain (tree_mask None) the first r nodes, node r - 1 included."""
    if tree_mask is None:
        return torch.ones(rows, rows, dtype=torch.bool).tril()[:, 1:]
    return tree_mask[:rows, 1:]


def children_lists(parents: torch.Tensor) -> list[list[int]]:
    """children_lists(parents)[r] lists the nodes whose parent is row r - 1 (r = 0: the root),
    in draft order: the order the verifier tries siblings in."""
    children: list[list[int]] = [[] for _ in range(parents.shape[0] + 1)]
    for node, parent in enumerate(parents.tolist()):
        children[parent + 1].append(node)
    return children


def best_nodes(parents: list[int], scores: list[float], depths: list[int], num_nodes: int) -> tuple[list[int], list[int]]:
    """The num_nodes best-scored nodes of a candidate tree whose scores never rise from parent to
    child (log path probabilities), as a tree again: (chosen node ids best first, their parents
    re-indexed into that order). Sorting by (-score, depth) puts every parent before its children."""
    order = sorted(range(len(parents)), key=lambda node: (-scores[node], depths[node]))[:num_nodes]
    chosen = set(order)
    order = [node for node in order if _ancestors_chosen(node, parents, chosen)]
    index_of = {node: index for index, node in enumerate(order)}
    return order, [index_of[parents[node]] if parents[node] >= 0 else -1 for node in order]


def _ancestors_chosen(node: int, parents: list[int], chosen: set[int]) -> bool:
    while parents[node] >= 0:
        node = parents[node]
        if node not in chosen:
            return False
    return True
