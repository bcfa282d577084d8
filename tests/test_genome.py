"""Cells as computation graphs (Jozefowicz et al. 2015 §3.2): the genome string, and the ``genome`` architecture
against the zoo's hand-written cells given the same weights."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from torch import nn

import zoo
from search.mutation import TRANSFORMATIONS, _Editable, _transform, mutate
from zoo.genome import ACTIVATIONS, GENOMES, CellGraph, GenomeError, GenomeLayer, Node, format_genome, parse


@pytest.mark.parametrize("name", list(GENOMES))
def test_genome_strings_round_trip(name: str) -> None:
    graph = parse(name)
    text = format_genome(graph)
    assert text == GENOMES[name]  # the registered strings are already canonical
    assert parse(text) == graph and format_genome(parse(text)) == text
    assert graph.canonical() == graph


def test_the_format_inlines_what_is_read_once_and_names_what_is_shared() -> None:
    graph = CellGraph(
        states=("h",),
        nodes=(
            Node("input"),
            Node("input"),
            Node("lin0", (1,)),  # 2: W x + b
            Node("tanh", (0,)),  # 3: tanh(h)
            Node("-", (2, 3)),  # 4
            Node("*", (4, 4)),  # 5: read twice
            Node("sigmoid", (1,)),  # 6: no output depends on it
            Node("+", (5, 0)),  # 7
            Node("-", (0, 7)),  # 8: h - (... + h): the right operand needs parentheses
        ),
        outputs=(8,),
    )
    text = format_genome(graph)
    assert text == "h: v0 = lin0(x) - tanh(h); h' = h - (v0 * v0 + h)"
    again = parse(text)
    assert format_genome(again) == text
    assert len(again.nodes) == len(graph.nodes) - 1  # the unused sigmoid is gone


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("h: h' = tanh(lin0(x) + lin0(y))", "reads 'y' before assigning it"),
        ("h, c: h' = tanh(lin0(x))", "never assigns c'"),
        ("h: h' = tanh(lin0(x)) $", "cannot read the genome"),
        ("h: a = lin0(x); a = lin0(h); h' = a", "assigns 'a', which is taken"),
        ("h: q' = lin0(x); h' = q'", "is not the new value of a state"),
        ("h: h' = tanh(lin0(x) + lin0(h)", "expected )"),
        ("x: x' = lin0(x)", "distinct state names other than x"),
    ],
)
def test_bad_genomes_say_what_is_wrong(text: str, fragment: str) -> None:
    with pytest.raises(GenomeError, match=None) as error:
        parse(text)
    assert fragment in str(error.value)


# ------------------------------------------------------------------------------- the same function as the zoo cells
Rows = tuple[str, slice]  # a parameter of the zoo layer and the rows of it that one genome Linear holds
Pair = tuple[Rows, list[Rows]]  # its weight rows and the bias rows that sum to its bias (none: a zero bias)


def blocks(count: int, size: int) -> list[slice]:
    return [slice(k * size, (k + 1) * size) for k in range(count)]


def lstm_weights(H: int) -> list[Pair]:
    """nn.LSTM's gates i, f, g, o; the genome's Linears: per gate lin(x), then lin(h)."""
    return [
        pair
        for rows in blocks(4, H)
        for pair in (
            (("rnn.weight_ih_l0", rows), [("rnn.bias_ih_l0", rows), ("rnn.bias_hh_l0", rows)]),
            (("rnn.weight_hh_l0", rows), []),
        )
    ]


def gru_paper_weights(H: int) -> list[Pair]:
    r, z, h = blocks(3, H)
    return [
        (("weight_ih", r), [("bias", r)]),
        (("weight_hh_rz", r), []),
        (("weight_ih", z), [("bias", z)]),
        (("weight_hh_rz", z), []),
        (("weight_ih", h), [("bias", h)]),
        (("weight_hh", slice(None)), []),
    ]


def rnn_tanh_weights(H: int) -> list[Pair]:
    every = slice(None)
    return [
        (("rnn.weight_ih_l0", every), [("rnn.bias_ih_l0", every), ("rnn.bias_hh_l0", every)]),
        (("rnn.weight_hh_l0", every), []),
    ]


def mut1_weights(H: int) -> list[Pair]:
    z, r, h = blocks(3, H)
    every = slice(None)
    return [
        (("weight_ih", z), [("bias", z)]),
        (("weight_ih", r), [("bias", r)]),
        (("weight_hr", every), []),
        (("weight_hh", every), [("bias", h)]),
    ]


def mut2_weights(H: int) -> list[Pair]:
    z, r, h = blocks(3, H)
    every = slice(None)
    return [
        (("weight_ih", z), [("bias", z)]),
        (("weight_hh_zr", z), []),
        (("weight_hh_zr", r), [("bias", r)]),
        (("weight_hh", every), [("bias", h)]),
        (("weight_ih", r), []),  # weight_ih's second block is W_xh
    ]


def mut3_weights(H: int) -> list[Pair]:
    z, r, h = blocks(3, H)
    every = slice(None)
    return [
        (("weight_ih", z), [("bias", z)]),
        (("weight_hz", every), []),
        (("weight_ih", r), [("bias", r)]),
        (("weight_hr", every), []),
        (("weight_hh", every), []),
        (("weight_ih", h), [("bias", h)]),
    ]


# Each zoo cell's weights in the order its genome's Linear nodes read them (the genomes in zoo/genome.py).
WEIGHTS: dict[str, Callable[[int], list[Pair]]] = {
    "lstm": lstm_weights,
    "gru_paper": gru_paper_weights,
    "rnn_tanh": rnn_tanh_weights,
    "mut1": mut1_weights,
    "mut2": mut2_weights,
    "mut3": mut3_weights,
}


def genome_twin(name: str, reference: nn.Module, size: int, layers: int) -> nn.Module:
    """A ``genome`` stack running the named cell's genome with ``reference``'s weights."""
    twin = zoo.build("genome", size, size, layers, genome=name).double()
    with torch.no_grad():
        for mine, theirs in zip(twin.layers, reference.layers, strict=True):
            nodes, pairs = mine.graph.linear_nodes(), WEIGHTS[name](size)
            assert len(nodes) == len(pairs)
            for index, ((weight, rows), biases) in zip(nodes, pairs, strict=True):
                getattr(mine, f"weight_{index}").copy_(theirs.get_parameter(weight)[rows])
                bias = sum((theirs.get_parameter(b)[r] for b, r in biases), torch.zeros(size, dtype=torch.float64))
                getattr(mine, f"bias_{index}").copy_(bias)
    return twin


@pytest.mark.parametrize("name", list(GENOMES))
def test_each_genome_computes_its_zoo_cell(name: str) -> None:
    """Outputs, final states and every gradient equal the hand-written cell's, over a window with a reset inside
    it and a carried state, two layers, float64."""
    torch.manual_seed(0)
    size, layers = 5, 2
    options = {"fused": False} if name in ("lstm", "rnn_tanh") else {}
    reference = zoo.build(name, size, size, layers, **options).double()
    twin = genome_twin(name, reference, size, layers)
    x = torch.randn(3, 6, size, dtype=torch.float64)
    reset = torch.zeros(3, 6, dtype=torch.bool)
    reset[1, 3] = True
    state = tuple(torch.randn_like(s) for s in reference.initial_state(3, x))
    outputs = []
    for model in (reference, twin):
        y, final = model(x, state, reset)
        (y.square().sum() + sum(s.sin().sum() for s in final)).backward()
        outputs.append((y, final))
    (y_ref, state_ref), (y, new_state) = outputs
    torch.testing.assert_close(y, y_ref)
    for mine, theirs in zip(new_state, state_ref, strict=True):
        torch.testing.assert_close(mine, theirs)
    for mine, theirs in zip(twin.layers, reference.layers, strict=True):
        for index, ((weight, rows), biases) in zip(mine.graph.linear_nodes(), WEIGHTS[name](size), strict=True):
            torch.testing.assert_close(getattr(mine, f"weight_{index}").grad, theirs.get_parameter(weight).grad[rows])
            for bias, bias_rows in biases:  # every bias that sums into this Linear's gets its gradient
                torch.testing.assert_close(
                    getattr(mine, f"bias_{index}").grad, theirs.get_parameter(bias).grad[bias_rows]
                )


def test_linear_a_puts_a_on_the_diagonal_also_after_init_range() -> None:
    stack = zoo.build("genome", 4, 4, 1, genome="h: h' = tanh(lin1.1(h) + lin0.9(x))", init_range=0.0)
    layer = stack.layers[0]
    weights = {layer.graph.nodes[i].op: getattr(layer, f"weight_{i}") for i in layer.graph.linear_nodes()}
    torch.testing.assert_close(weights["lin1.1"], 1.1 * torch.eye(4))
    torch.testing.assert_close(weights["lin0.9"], 0.9 * torch.eye(4))


def test_x_meeting_a_hidden_value_needs_one_width() -> None:
    with pytest.raises(GenomeError, match="input_size == hidden_size"):
        GenomeLayer(3, 4, parse("mut1"))
    GenomeLayer(3, 4, parse("lstm"))  # x only through Linears: any input width


def test_recurrent_weights_are_those_reading_the_state() -> None:
    layer = GenomeLayer(4, 4, parse("mut1"))
    nodes = layer.graph.nodes
    for name in layer.recurrent_weights:
        index = int(name.split("_")[1])
        assert nodes[index].op == "lin0" and nodes[index].args[0] != layer.graph.x
    assert len(layer.recurrent_weights) == 2  # W_hr h and W_hh (r * h); z reads x only


# -------------------------------------------------------------------------------------------------- mutations
def test_mutants_are_valid_cells_and_every_transformation_occurs() -> None:
    """Over many seeds and every registered parent: each mutant is a canonical graph that differs from its parent,
    reads x, round-trips as a string, and runs as a layer; all six transformations of §3.2 are applied."""
    kinds: list[int] = []
    sizes = []
    for seed in range(300):
        parent = parse(list(GENOMES)[seed % len(GENOMES)])
        child = mutate(parent, random.Random(seed), applied=kinds)
        assert child != parent and child.canonical() == child
        assert parse(format_genome(child)) == child
        assert any(child.x in child.depends_on()[o] for o in child.outputs)
        assert len(child.nodes) <= 64 and child.num_states == parent.num_states
        layer = GenomeLayer(4, 4, child)
        y, state = layer(torch.randn(2, 3, 4), layer.initial_state(2, torch.zeros(1)), {})
        assert y.shape == (2, 3, 4) and len(state) == parent.num_states
        sizes.append(len(child.nodes) - len(parent.nodes))
    assert set(kinds) == set(TRANSFORMATIONS)
    assert min(sizes) < 0 < max(sizes)  # mutations both shrink and grow cells
    # The same seed gives the same mutant.
    assert mutate(parse("lstm"), random.Random(7)) == mutate(parse("lstm"), random.Random(7))


def test_no_mutant_computes_nothing_since_it_could_never_be_mutated_again() -> None:
    """A small cell's transformation 5 can make ``h' = x``; no transformation anchors to an input, so such a mutant
    would be a dead end in the top list (CI once drew one as a parent and mutation never ended). It is rejected,
    and a parent like it is refused at once with a line that says why."""
    parent = parse("h: h' = tanh(x + lin0(h))")
    for seed in range(300):
        child = mutate(parent, random.Random(seed))
        assert any(node.op != "input" for node in child.nodes)
    with pytest.raises(ValueError, match="no node to mutate"):
        mutate(parse("h: h' = x"), random.Random(0))


def edited(text: str) -> _Editable:
    return _Editable.of(parse(text))


def node_named(graph: _Editable, name: str) -> int:
    return graph.names.index(name)


def test_each_transformation_does_what_section_3_2_says() -> None:
    rng = random.Random(0)
    base = "h: a = tanh(lin0(x)); b = a + lin0(h); h' = sigmoid(b) * h"
    # 1: an activation becomes another one.
    graph = edited(base)
    a = node_named(graph, "a")
    assert _transform(graph, 1, a, rng) and graph.ops[a] in ACTIVATIONS and graph.ops[a] != "tanh"
    # 2: an operation becomes another one; an activation is not an operation.
    graph = edited(base)
    b = node_named(graph, "b")
    assert _transform(graph, 2, b, rng) and graph.ops[b] in ("-", "*")
    assert not _transform(edited(base), 2, a, rng)
    # 3: an activation between a node and one of its parents.
    graph = edited(base)
    assert _transform(graph, 3, a, rng)
    inserted = graph.args[a][0]
    assert graph.ops[inserted] in ACTIVATIONS and graph.ops[graph.args[inserted][0]] == "lin0"
    # 4: a one-input, one-reader node goes; its reader reads its input. A node read twice stays.
    graph = edited(base)
    assert _transform(graph, 4, a, rng)
    assert graph.ops[graph.args[b][0]] == "lin0"
    shared = edited("h: a = tanh(lin0(x)); h' = a * a")
    assert not _transform(shared, 4, node_named(shared, "a"), rng)
    # 5: readers read an ancestor instead.
    graph = edited(base)
    assert _transform(graph, 5, b, rng)
    output = graph.args[graph.outputs[0]][0]  # sigmoid(...) now reads an ancestor of b
    assert graph.args[output][0] in edited(base).ancestors(b)
    # 6: the node is replaced by an operation of its ancestor and one of another node's.
    graph = edited(base)
    for seed in range(20):  # some draws pick an input as the other node, which has no ancestors
        trial = graph.copy()
        if _transform(trial, 6, b, random.Random(seed)):
            sigmoid = trial.args[trial.outputs[0]][0]
            new = trial.args[sigmoid][0]  # what sigmoid(b) reads now
            assert trial.ops[new] in ("+", "-", "*") and trial.args[new][0] in graph.ancestors(b)
            break
    else:
        raise AssertionError("transformation 6 never applied")
