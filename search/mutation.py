"""Mutations of a cell's computation graph, the six transformations of Jozefowicz et al. 2015 §3.2.

Each transformation is anchored to a "current node" (any node but the inputs):

1. an activation is replaced by another activation (``tanh``, ``sigmoid``, ``relu``, ``lin0``, ``lin1``, ``lin0.9``,
   ``lin1.1``; a Linear counts as one, §3.2);
2. an elementwise operation is replaced by another one of ``+``, ``-``, ``*``;
3. a random activation is inserted between the node and one of its parents;
4. the node is removed if it has one input and one output (its reader then reads its input);
5. the node is replaced by one of its ancestors (every node it depends on): its readers read that ancestor;
6. a random node A is chosen, and the node is replaced by the sum, product or difference of a random ancestor of
   the node and a random ancestor of A.

How they are applied, as §3.2 says: "choosing a probability p uniformly at random from [0, 1] and independently apply
a randomly chosen transformation ... with probability p to each node in the graph ... this way, most of the mutations
are small while some are large. We apply 1-3 of these transformations". The paper leaves open whether "1-3" counts
transformation kinds or applications; since p is what sets a mutation's size, we read it as kinds: a mutation draws
p, and 1 to 3 of the six kinds, and each node independently, with probability p, undergoes one of those kinds (where
it applies). A transformation that would make the graph cyclic (6, when A's ancestor depends on the node) is not
applied. The result is rejected, and another drawn, if it is the parent again, if no new state depends on x (a cell
must read its input), if it computes nothing (every new state is an input, as in ``h' = x``: no transformation
anchors to an input, so such a cell could never be mutated again, and §3.2's "try again, until we find an
architecture that is accepted" would never end), or if it has more than ``max_nodes`` nodes (a guard of ours; the
paper names none). The number of outputs always matches the number of state inputs here, which is §3.2's other
rejection rule.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from zoo.genome import ACTIVATIONS, INPUT, OPERATIONS, CellGraph, Node

TRANSFORMATIONS = (1, 2, 3, 4, 5, 6)


@dataclass
class _Editable:
    """A graph under edit: node ids are stable (new nodes are appended, replaced ones are left unread), and readers
    may point to later ids until :meth:`freeze` orders the nodes again."""

    states: tuple[str, ...]
    ops: list[str]
    args: list[list[int]]
    names: list[str | None]
    outputs: list[int]
    applied: list[tuple[int, int]] = field(default_factory=list)  # (transformation, node)

    @classmethod
    def of(cls, graph: CellGraph) -> _Editable:
        names = list(graph.names) + [None] * (len(graph.nodes) - len(graph.names))
        return cls(graph.states, [n.op for n in graph.nodes], [list(n.args) for n in graph.nodes], names,
                   list(graph.outputs))  # fmt: skip

    def copy(self) -> _Editable:
        return _Editable(self.states, list(self.ops), [list(a) for a in self.args], list(self.names),
                         list(self.outputs), list(self.applied))  # fmt: skip

    def add(self, op: str, args: list[int]) -> int:
        self.ops.append(op)
        self.args.append(args)
        self.names.append(None)
        return len(self.ops) - 1

    def live(self) -> list[int]:
        """The nodes some output depends on, inputs included, in a reading order."""
        order: list[int] = []
        seen: set[int] = set()

        def visit(node: int) -> None:
            if node in seen:
                return
            seen.add(node)
            for a in self.args[node]:
                visit(a)
            order.append(node)

        for o in self.outputs:
            visit(o)
        return order

    def ancestors(self, node: int) -> set[int]:
        """Every node ``node`` depends on (not itself)."""
        found: set[int] = set()
        stack = list(self.args[node])
        while stack:
            a = stack.pop()
            if a not in found:
                found.add(a)
                stack.extend(self.args[a])
        return found

    def readers(self, node: int) -> int:
        """How many times ``node`` is read, by live nodes and as a new state."""
        live = set(self.live())
        return sum(args.count(node) for i, args in enumerate(self.args) if i in live) + self.outputs.count(node)

    def redirect(self, old: int, new: int) -> None:
        """Every reader of ``old`` reads ``new`` instead."""
        for args in self.args:
            args[:] = [new if a == old else a for a in args]
        self.outputs = [new if o == old else o for o in self.outputs]

    def acyclic(self) -> bool:
        state = [0] * len(self.ops)  # 0 unseen, 1 on the path, 2 done

        def visit(node: int) -> bool:
            if state[node] == 1:
                return False
            if state[node] == 2:
                return True
            state[node] = 1
            ok = all(visit(a) for a in self.args[node])
            state[node] = 2
            return ok

        return all(visit(o) for o in self.outputs)

    def freeze(self) -> CellGraph:
        """The edited cell as a canonical :class:`CellGraph` (inputs first, unread nodes dropped)."""
        inputs = list(range(len(self.states) + 1))
        order = inputs + [n for n in self.live() if self.ops[n] != INPUT]
        index = {node: i for i, node in enumerate(order)}
        nodes = tuple(Node(self.ops[n], tuple(index[a] for a in self.args[n])) for n in order)
        graph = CellGraph(
            self.states, nodes, tuple(index[o] for o in self.outputs), tuple(self.names[n] for n in order)
        )
        return graph.canonical()


def _transform(graph: _Editable, kind: int, node: int, rng: random.Random) -> bool:
    """Apply transformation ``kind`` anchored at ``node``; ``False`` where it does not apply (nothing changed)."""
    op, args = graph.ops[node], graph.args[node]
    if kind == 1 and op in ACTIVATIONS:
        graph.ops[node] = rng.choice([a for a in ACTIVATIONS if a != op])
    elif kind == 2 and op in OPERATIONS:
        graph.ops[node] = rng.choice([o for o in OPERATIONS if o != op])
    elif kind == 3:
        position = rng.randrange(len(args))
        args[position] = graph.add(rng.choice(ACTIVATIONS), [args[position]])
    elif kind == 4 and op in ACTIVATIONS and graph.readers(node) == 1:
        graph.redirect(node, args[0])
    elif kind == 5:
        graph.redirect(node, rng.choice(sorted(graph.ancestors(node))))
    elif kind == 6:
        other = rng.choice([n for n in range(len(graph.ops)) if n in set(graph.live())])
        theirs = graph.ancestors(other)
        if not theirs:  # A is an input: it has no ancestors
            return False
        mine = sorted(graph.ancestors(node))
        new = graph.add(rng.choice(OPERATIONS), [rng.choice(mine), rng.choice(sorted(theirs))])
        graph.redirect(node, new)
        graph.args[new] = [a if a != new else node for a in graph.args[new]]  # redirect touched the new node too
    else:
        return False
    return True


def _computes_nothing(graph: CellGraph) -> bool:
    return all(node.op == INPUT for node in graph.nodes)


def mutate(
    graph: CellGraph,
    rng: random.Random,
    max_nodes: int = 64,
    max_tries: int = 1000,
    applied: list[int] | None = None,
) -> CellGraph:
    """A mutant of ``graph`` (module docstring), drawn from ``rng``.

    Args:
        graph: the parent cell.
        rng: the only source of randomness, so a seed fixes the mutant.
        max_nodes: mutants with more nodes are rejected.
        max_tries: give up after this many rejected mutants.
        applied: if given, receives the transformation (1-6) of every change the mutant carries.

    Raises:
        ValueError: ``graph`` computes nothing, so no transformation applies.
        RuntimeError: no acceptable mutant within ``max_tries``.
    """
    parent = graph.canonical()
    if _computes_nothing(parent):
        raise ValueError(f"{parent} has no node to mutate: every new state is an input")
    for _ in range(max_tries):
        edit = _Editable.of(parent)
        p = rng.random()
        kinds = rng.sample(TRANSFORMATIONS, rng.randint(1, 3))
        for node in [n for n in edit.live() if edit.ops[n] != INPUT]:
            if node not in set(edit.live()) or rng.random() >= p:
                continue
            kind = rng.choice(kinds)
            trial = edit.copy()
            if _transform(trial, kind, node, rng) and trial.acyclic():
                trial.applied.append((kind, node))
                edit = trial
        if not edit.applied:
            continue
        mutant = edit.freeze()
        x_reaches = any(mutant.x in inputs for inputs in (mutant.depends_on()[o] for o in mutant.outputs))
        if mutant != parent and x_reaches and not _computes_nothing(mutant) and len(mutant.nodes) <= max_nodes:
            if applied is not None:
                applied.extend(kind for kind, _ in edit.applied)
            return mutant
    raise RuntimeError(f"no acceptable mutant of {parent} in {max_tries} tries")
