"""Recurrent cells as computation graphs, the representation of Jozefowicz, Zaremba & Sutskever 2015's architecture
search (§3.2), and a zoo architecture (``genome``) that runs any of them.

A cell with M state vectors has M + 1 inputs (the previous states and the input x) and M outputs (the new states).
Every other node is one of

* an activation of one node: ``tanh``, ``sigmoid``, ``relu``, or ``Linear(a)``, written ``lin0``, ``lin1``,
  ``lin0.9``, ``lin1.1``: a new square matrix W and bias b, ``W v + b``, with ``a`` added to W's diagonal at
  initialisation (§3.2: "the scalar value a is added to its diagonal entries");
* an elementwise operation of two nodes: ``+``, ``-``, ``*``.

All nodes have the hidden size, except x and what is computed from x without a Linear: where such a value meets a
hidden-size one, the input size must equal the hidden size (the paper's setting: every node has one width).

A genome is written as the state names, a colon, and assignments separated by ``;``; a primed name is a state's new
value, and the first state is the layer's output ``h``. The LSTM::

    h, c: i = sigmoid(lin0(x) + lin0(h)); f = sigmoid(lin0(x) + lin0(h)); j = tanh(lin0(x) + lin0(h));
          o = sigmoid(lin0(x) + lin0(h)); c' = f * c + i * j; h' = o * tanh(c')

Every ``lin`` is a parameter of its own, so ``lin0(x) + lin0(h)`` is ``W_x x + b_x + W_h h + b_h`` (two biases
whose sum is the usual one). The graph has no constants: the GRU's ``z * h + (1 - z) * u`` is written
``u + z * (h - u)``. :data:`GENOMES` holds the paper's cells; the tests hold each equal to the zoo's hand-written cell
given the same weights.

Speed: the nodes that depend on x alone are computed for the whole window at once (all their Linears as one
matmul), and at every step the Linears that read the same node share one matmul, as the hand-written cells do
(``benchmarks/cells.py`` compares them).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from zoo.kernels import RecurrentMatmul, window_linear
from zoo.layers import CellLayer
from zoo.stack import RecurrentStack
from zoo.state import State

INPUT = "input"
LINEARS = {"lin0": 0.0, "lin1": 1.0, "lin0.9": 0.9, "lin1.1": 1.1}  # Linear(a): the name -> a
ACTIVATIONS = ("tanh", "sigmoid", "relu", *LINEARS)  # §3.2's permissible nonlinearities
OPERATIONS = ("+", "-", "*")
X = "x"

# The paper's cells (§2, §4), each the function of the zoo architecture of the same name.
GENOMES = {
    "lstm": (
        "h, c: i = sigmoid(lin0(x) + lin0(h)); f = sigmoid(lin0(x) + lin0(h)); j = tanh(lin0(x) + lin0(h)); "
        "o = sigmoid(lin0(x) + lin0(h)); c' = f * c + i * j; h' = o * tanh(c')"
    ),
    "gru_paper": (
        "h: r = sigmoid(lin0(x) + lin0(h)); z = sigmoid(lin0(x) + lin0(h)); u = tanh(lin0(x) + lin0(r * h)); "
        "h' = u + z * (h - u)"
    ),
    "rnn_tanh": "h: h' = tanh(lin0(x) + lin0(h))",
    "mut1": (
        "h: z = sigmoid(lin0(x)); r = sigmoid(lin0(x) + lin0(h)); u = tanh(lin0(r * h) + tanh(x)); h' = h + z * (u - h)"
    ),
    "mut2": (
        "h: z = sigmoid(lin0(x) + lin0(h)); r = sigmoid(x + lin0(h)); u = tanh(lin0(r * h) + lin0(x)); "
        "h' = h + z * (u - h)"
    ),
    "mut3": (
        "h: z = sigmoid(lin0(x) + lin0(tanh(h))); r = sigmoid(lin0(x) + lin0(h)); u = tanh(lin0(r * h) + lin0(x)); "
        "h' = h + z * (u - h)"
    ),
}


class GenomeError(ValueError):
    """A genome string or graph that does not describe a cell (the message says where)."""


@dataclass(frozen=True)
class Node:
    """One node: ``op`` is ``"input"``, an activation or an operation; ``args`` index earlier nodes."""

    op: str
    args: tuple[int, ...] = ()


@dataclass(frozen=True)
class CellGraph:
    """A cell's computation graph.

    Attributes:
        states: the names of the M state vectors; the first is the layer's output.
        nodes: nodes ``0 .. M-1`` are the states, node ``M`` is x, every later node reads earlier ones only.
        outputs: for each state, the node holding its new value.
        names: a display name per node (``None`` where it has none); not part of the graph's identity.
    """

    states: tuple[str, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[int, ...]
    names: tuple[str | None, ...] = field(default=(), compare=False)

    @property
    def num_states(self) -> int:
        return len(self.states)

    @property
    def x(self) -> int:
        """The index of the input node x."""
        return len(self.states)

    def __post_init__(self) -> None:
        m = len(self.states)
        if m < 1 or len(set(self.states)) != m or X in self.states:
            raise GenomeError(f"a cell needs one or more distinct state names other than x, got {self.states}")
        if len(self.outputs) != m:
            raise GenomeError(f"{m} states need {m} outputs, got {len(self.outputs)}")
        for index, node in enumerate(self.nodes):
            arity = 0 if node.op == INPUT else 1 if node.op in ACTIVATIONS else 2 if node.op in OPERATIONS else None
            if arity is None:
                raise GenomeError(f"node {index} has the unknown operation {node.op!r}")
            if (node.op == INPUT) != (index <= m) or len(node.args) != arity:
                raise GenomeError(f"node {index} ({node.op}) is malformed")
            if any(not 0 <= a < index for a in node.args):
                raise GenomeError(f"node {index} reads a node that does not come before it")
        if any(not 0 <= o < len(self.nodes) for o in self.outputs):
            raise GenomeError("an output names a node the graph does not have")

    # ------------------------------------------------------------------------------------------------ structure
    def consumers(self) -> list[int]:
        """How many times each node is read (by nodes and as an output)."""
        count = [0] * len(self.nodes)
        for node in self.nodes:
            for a in node.args:
                count[a] += 1
        for o in self.outputs:
            count[o] += 1
        return count

    def depends_on(self) -> list[set[int]]:
        """For each node, the input nodes (states and x) it depends on."""
        found: list[set[int]] = []
        for index, node in enumerate(self.nodes):
            found.append({index} if node.op == INPUT else set().union(*(found[a] for a in node.args)))
        return found

    def linear_nodes(self) -> list[int]:
        """The nodes that carry parameters, in order."""
        return [i for i, node in enumerate(self.nodes) if node.op in LINEARS]

    def canonical(self) -> CellGraph:
        """The same cell with unused nodes dropped and nodes numbered as its genome string reads them."""
        return parse(format_genome(self))

    def __str__(self) -> str:
        return format_genome(self)


# ---------------------------------------------------------------------------------------------- the string form
_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_.]*'?)|(?P<symbol>[-+*()=;:,]))")


def _tokens(text: str) -> list[str]:
    tokens, position, text = [], 0, text.strip()
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None or match.end() == position:
            raise GenomeError(f"cannot read the genome at {text[position : position + 20]!r}")
        tokens.append(match.group("name") or match.group("symbol"))
        position = match.end()
    return tokens


class _Parser:
    """Recursive descent over the tokens: ``expr = term (("+" | "-") term)*``, ``term = factor ("*" factor)*``,
    ``factor = activation "(" expr ")" | "(" expr ")" | name``."""

    def __init__(self, text: str) -> None:
        self.tokens = _tokens(text)
        self.position = 0
        self.nodes: list[Node] = []
        self.names: list[str | None] = []
        self.scope: dict[str, int] = {}

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise GenomeError(f"expected {expected or 'more'} at token {self.position} of the genome, got {token!r}")
        self.position += 1
        return token

    def add(self, op: str, *args: int) -> int:
        self.nodes.append(Node(op, args))
        self.names.append(None)
        return len(self.nodes) - 1

    def expression(self) -> int:
        left = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            left = self.add(op, left, self.term())
        return left

    def term(self) -> int:
        left = self.factor()
        while self.peek() == "*":
            self.take()
            left = self.add("*", left, self.factor())
        return left

    def factor(self) -> int:
        token = self.take()
        if token == "(":
            inner = self.expression()
            self.take(")")
            return inner
        if token in ACTIVATIONS and self.peek() == "(":
            self.take("(")
            inner = self.expression()
            self.take(")")
            return self.add(token, inner)
        if token not in self.scope:
            raise GenomeError(f"the genome reads {token!r} before assigning it")
        return self.scope[token]

    def parse(self) -> CellGraph:
        states = [self.take()]
        while self.peek() == ",":
            self.take()
            states.append(self.take())
        self.take(":")
        if len(set(states)) != len(states) or X in states:
            raise GenomeError(f"a cell needs distinct state names other than x, got {', '.join(states)}")
        for name in [*states, X]:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or name in ACTIVATIONS:
                raise GenomeError(f"{name!r} cannot name a state")
            self.scope[name] = self.add(INPUT)
            self.names[-1] = name
        new_values: dict[str, int] = {}
        while True:
            target = self.take()
            self.take("=")
            if target in self.scope or target in ACTIVATIONS or target.rstrip("'") == X:
                raise GenomeError(f"the genome assigns {target!r}, which is taken")
            if target.endswith("'") and target[:-1] not in states:
                raise GenomeError(f"{target!r} is not the new value of a state ({', '.join(states)})")
            value = self.expression()
            self.scope[target] = value
            if target.endswith("'"):
                new_values[target[:-1]] = value
            if self.names[value] is None:
                self.names[value] = target
            if self.peek() is None:
                break
            self.take(";")
        missing = [s for s in states if s not in new_values]
        if missing:
            raise GenomeError(f"the genome never assigns {', '.join(s + chr(39) for s in missing)}")
        return CellGraph(tuple(states), tuple(self.nodes), tuple(new_values[s] for s in states), tuple(self.names))


def parse(text: str) -> CellGraph:
    """Read a genome string (see the module docstring); a registered name (:data:`GENOMES`) reads its genome.

    Raises:
        GenomeError: the text is not a genome; the message says what is wrong.
    """
    return _Parser(GENOMES.get(text, text)).parse()


_LEVEL = {"+": 1, "-": 1, "*": 2}


def format_genome(graph: CellGraph) -> str:
    """The genome string of ``graph``: a state's new value, a node with a name and a node read more than once get an
    assignment of their own (named as in the graph where the name is free, ``v<n>`` otherwise); the others are
    written inline. Nodes no output depends on are left out."""
    used = [False] * len(graph.nodes)
    for o in graph.outputs:
        used[o] = True
    for index in range(len(graph.nodes) - 1, -1, -1):  # args come before their readers
        if used[index]:
            for a in graph.nodes[index].args:
                used[a] = True
    reads = [0] * len(graph.nodes)
    for index, node in enumerate(graph.nodes):
        if used[index]:
            for a in node.args:
                reads[a] += 1
    label: dict[int, str] = {i: name for i, name in enumerate(graph.states)}
    label[graph.x] = X
    taken = set(label.values())
    outputs_of: dict[int, list[str]] = {}
    for state, o in zip(graph.states, graph.outputs, strict=True):
        outputs_of.setdefault(o, []).append(state + "'")

    def write(index: int, parent_level: int = 0, right: bool = False) -> str:
        if index in label:
            return label[index]
        node = graph.nodes[index]
        if node.op in ACTIVATIONS:
            return f"{node.op}({write(node.args[0])})"
        level = _LEVEL[node.op]
        text = f"{write(node.args[0], level)} {node.op} {write(node.args[1], level, right=True)}"
        # Left-associative: a right operand of the same level, or any looser one, needs parentheses.
        return f"({text})" if parent_level > level or (right and parent_level == level) else text

    def given_name(index: int) -> str | None:
        name = graph.names[index] if index < len(graph.names) else None
        return name if name is not None and re.fullmatch(r"[a-z][a-z0-9_]*", name) else None

    statements = []
    for index in range(graph.x + 1, len(graph.nodes)):
        if not used[index] or (index not in outputs_of and reads[index] < 2 and given_name(index) is None):
            continue
        expression = write(index)
        if index in outputs_of:
            names = outputs_of[index]
            statements.append(f"{names[0]} = {expression}")
            statements += [f"{name} = {names[0]}" for name in names[1:]]
            label[index] = names[0]
        else:
            name = given_name(index)
            if name is None or name in taken:
                name = next(f"v{n}" for n in range(len(graph.nodes)) if f"v{n}" not in taken)
            taken.add(name)
            statements.append(f"{name} = {expression}")
            label[index] = name
    for state, o in zip(graph.states, graph.outputs, strict=True):  # a state passed on unchanged (or as an input)
        if o <= graph.x:
            statements.append(f"{state}' = {label[o]}")
    return f"{', '.join(graph.states)}: " + "; ".join(statements)


# ------------------------------------------------------------------------------------------------ the layer
class GenomeLayer(CellLayer):
    """One layer running a :class:`CellGraph`: each Linear node has a ``weight_<n>`` ``(H, width)`` and ``bias_<n>``
    ``(H,)`` (``n`` its node index).

    Args:
        input_size: width of x.
        hidden_size: width of every other node.
        graph: the cell.

    Raises:
        GenomeError: the graph combines x (or a value computed from it without a Linear) with a hidden-size value
            while ``input_size != hidden_size``.
    """

    def __init__(self, input_size: int, hidden_size: int, graph: CellGraph) -> None:
        super().__init__(input_size, hidden_size)
        self.graph = graph
        self.state_size = graph.num_states
        width = [hidden_size] * len(graph.nodes)
        width[graph.x] = input_size
        for index, node in enumerate(graph.nodes):
            if node.op in LINEARS:
                width[index] = hidden_size
            elif node.op in ACTIVATIONS:
                width[index] = width[node.args[0]]
            elif node.op in OPERATIONS:
                a, b = (width[arg] for arg in node.args)
                if a != b:
                    raise GenomeError(
                        f"the genome combines x (width {input_size}) with a width-{hidden_size} value at node "
                        f"{index}: use input_size == hidden_size (e.g. embedding_size = hidden_size)"
                    )
                width[index] = a
        for state, o in zip(graph.states, graph.outputs, strict=True):
            if width[o] != hidden_size:
                raise GenomeError(f"the new {state} would have width {width[o]}, not the hidden size {hidden_size}")
        inputs = graph.depends_on()
        self.x_only = [index > graph.x and inputs[index] == {graph.x} for index in range(len(graph.nodes))]
        # Linear nodes grouped by the node they read: one matmul per group, hoisted when that node depends on x only.
        groups: dict[int, list[int]] = {}
        for index in graph.linear_nodes():
            groups.setdefault(graph.nodes[index].args[0], []).append(index)
        self.groups = groups
        for index in graph.linear_nodes():
            operand = graph.nodes[index].args[0]
            self.register_parameter(f"weight_{index}", nn.Parameter(torch.empty(hidden_size, width[operand])))
            self.register_parameter(f"bias_{index}", nn.Parameter(torch.empty(hidden_size)))
        self.recurrent_weights = tuple(
            f"weight_{i}" for operand, members in groups.items() if not self._hoisted(operand) for i in members
        )
        # The x-only values the recurrence reads (hoisted for the whole window); the rest is computed per step.
        self.carried = [
            index
            for index in range(len(graph.nodes))
            if self._hoisted(index) and any(r is None or not self._hoisted(r) for r in self._readers(index))
        ] or [graph.x]  # a cell that ignores x still steps once per input
        self.reset_parameters()

    def _hoisted(self, index: int) -> bool:
        return index == self.graph.x or self.x_only[index]

    def _readers(self, index: int) -> list[int | None]:
        """The nodes that read node ``index``, and ``None`` for each state it becomes (read at every step)."""
        readers: list[int | None] = [i for i, node in enumerate(self.graph.nodes) if index in node.args]
        return readers + [None] * self.graph.outputs.count(index)

    def reset_parameters(self) -> None:
        """Uniform(-1/sqrt(H), 1/sqrt(H)) like ``nn.LSTM`` (the stack's ``init_range`` overrides it), then each
        Linear(a)'s ``a`` on its diagonal."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)
        self.add_diagonals()

    def add_diagonals(self) -> None:
        """Add each Linear(a)'s ``a`` to its matrix's diagonal (§3.2), e.g. after a re-initialisation."""
        with torch.no_grad():
            for index in self.graph.linear_nodes():
                a = LINEARS[self.graph.nodes[index].op]
                if a:
                    weight = self.get_parameter(f"weight_{index}")
                    weight.add_(a * torch.eye(*weight.shape, dtype=weight.dtype, device=weight.device))

    def _group_weights(self, members: list[int]) -> tuple[Tensor, Tensor]:
        weight = torch.cat([getattr(self, f"weight_{i}") for i in members])  # (len * H, width)
        bias = torch.cat([getattr(self, f"bias_{i}") for i in members])
        return weight, bias

    def hoist(self, x: Tensor) -> tuple[Tensor, ...]:
        batch, steps, _ = x.shape
        graph, H = self.graph, self.hidden_size
        values: dict[int, Tensor] = {graph.x: x}  # (B, T, width) for every x-only node
        self.window.matmuls = {}
        for operand, members in self.groups.items():
            if not self._hoisted(operand):
                weight, bias = self._group_weights(members)
                self.window.matmuls[operand] = (RecurrentMatmul(weight, batch, steps), bias, members)
        for index in range(graph.x + 1, len(graph.nodes)):
            if not self.x_only[index] or index in values:
                continue
            node = graph.nodes[index]
            if node.op in LINEARS:  # the whole group on this operand, one matmul over the window
                weight, bias = self._group_weights(self.groups[node.args[0]])
                products = window_linear(values[node.args[0]], weight, bias).split(H, dim=-1)
                values.update(zip(self.groups[node.args[0]], products, strict=True))
            else:
                values[index] = _apply(node.op, [values[a] for a in node.args])
        return tuple(values[index] for index in self.carried)

    def step(self, x_t: tuple[Tensor, ...], state: State) -> State:
        graph, H = self.graph, self.hidden_size
        values: dict[int, Tensor] = dict(enumerate(state))  # the states are nodes 0 .. M-1
        values.update(zip(self.carried, x_t, strict=True))
        for index in range(graph.x + 1, len(graph.nodes)):
            if index in values or self.x_only[index]:
                continue
            node = graph.nodes[index]
            if node.op in LINEARS:  # every Linear on this operand at once
                matmul, bias, members = self.window.matmuls[node.args[0]]
                products = matmul(values[node.args[0]], add=bias).split(H, dim=1)  # (B, H) each
                values.update(zip(members, products, strict=True))
            else:
                values[index] = _apply(node.op, [values[a] for a in node.args])
        return tuple(values[o] for o in graph.outputs)


def _apply(op: str, args: list[Tensor]) -> Tensor:
    if op == "tanh":
        return torch.tanh(args[0])
    if op == "sigmoid":
        return torch.sigmoid(args[0])
    if op == "relu":
        return torch.relu(args[0])
    if op == "+":
        return args[0] + args[1]
    if op == "-":
        return args[0] - args[1]
    return args[0] * args[1]


class Genome(RecurrentStack):
    """A stack of layers running one cell genome (Jozefowicz et al. 2015 §3.2).

    The sizes and ``**stack_options`` are every stack's (:class:`~zoo.stack.RecurrentStack`).
    ``hidden_size`` is the width of every node but x; ``state_dropout`` acts on the first state, ``weight_drop`` on the
    Linears that read the state, and after ``init_range`` each Linear(a) gets its ``a`` on the diagonal again.

    Args:
        genome: a genome string (module docstring) or the name of one of :data:`GENOMES`.
    """

    def __init__(
        self, input_size: int, hidden_size: int, num_layers: int = 1, genome: str = "lstm", **stack_options: Any
    ) -> None:
        graph = parse(genome)
        super().__init__(partial(GenomeLayer, graph=graph), input_size, hidden_size, num_layers, **stack_options)
        if stack_options.get("init_range") is not None:
            for layer in self.layers:
                layer.add_diagonals()
        self.genome = format_genome(graph)
