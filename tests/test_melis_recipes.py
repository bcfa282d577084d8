"""The Melis et al. 2020 recipes are deepmind/lamb's released configurations, value for value (issue 15).

lamb's values are written out here as its config files give them (``experiment/mogrifier/config/<tuning>/trial_N/
config``); the test reads the shipped YAML the way ``lm-zoo fit`` does and checks every mapped setting, including the
two loss-scale translations (lamb sums the loss over the T steps of a window, lm-zoo averages per token: clip / T and
l2_penalty / T) and the hidden size that lamb's parameter budget rule solves for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

# lamb flag values per released trial.
LAMB: dict[str, dict[str, Any]] = {
    "ptb/mogrifier.yaml": {  # 786252db3825+_tune_ptb_24m_lstm_fm_d2_arms/trial_483
        "num_params": 24e6, "vocab": 10001, "tied": True, "rounds": 5, "rank": 84, "ratio": 1.0, "mos": 0,
        "input_dropout": 0.7290787773167251, "inter_layer_dropout": 0.2909822365241189,
        "state_dropout": 0.38729439899832296, "output_dropout": 0.7156690388448465,
        "learning_rate": 0.002299987130225388, "l2_penalty": 0.00025235335778471014,
        "batch_size": 64, "max_time_steps": 70, "turns": 1000, "trigger_averaging_turns": 50,
        "trigger_averaging_at_the_latest": 800,
    },
    "ptb/lstm-melis.yaml": {  # 786252db3825+_tune_ptb_24m_lstm_d2_arms/trial_833
        "num_params": 24e6, "vocab": 10001, "tied": True, "rounds": 0, "rank": 0, "ratio": 1.0, "mos": 0,
        "input_dropout": 0.6275626425150355, "inter_layer_dropout": 0.3069926535017156,
        "state_dropout": 0.3692225400980858, "output_dropout": 0.6901712653612706,
        "learning_rate": 0.0030369099569192135, "l2_penalty": 0.00024908138497223704,
        "batch_size": 64, "max_time_steps": 70, "turns": 1000, "trigger_averaging_turns": 50,
        "trigger_averaging_at_the_latest": 800,
    },
    "ptb-char/mogrifier.yaml": {  # 0393c7dc3532+_tune_ptb_char_24m_lstm_fm_d2_asgd_ts150/trial_596
        "num_params": 24e6, "vocab": 51, "tied": False, "rounds": 4, "rank": 24, "ratio": 1.0, "mos": 0,
        "input_dropout": 0.27860252841733274, "inter_layer_dropout": 0.0737609984911853,
        "state_dropout": 0.17118611234551975, "output_dropout": 0.2347428361918374,
        "learning_rate": 0.003739598828019367, "l2_penalty": 0.00025558089199237096,
        "batch_size": 64, "max_time_steps": 150, "turns": 500, "trigger_averaging_turns": 25,
        "trigger_averaging_at_the_latest": 400,
    },
    "wikitext-2/mogrifier.yaml": {  # c51c838b33a5+_tune_wikitext-2_35m_lstm_mos2_fm_d2_arms/trial_747
        "num_params": 35e6, "vocab": 33279, "tied": True, "rounds": 6, "rank": 48,
        "ratio": 0.1993194960596213, "mos": 2,
        "input_dropout": 0.5469087645499495, "inter_layer_dropout": 0.1988228263748591,
        "state_dropout": 0.22137985867236876, "output_dropout": 0.34766651193735193,
        "learning_rate": 0.003287792100749033, "l2_penalty": 0.00018994987193751323,
        "batch_size": 64, "max_time_steps": 70, "turns": 1000, "trigger_averaging_turns": 50,
        "trigger_averaging_at_the_latest": 800,
    },
    "wikitext-2/lstm-melis.yaml": {  # c51c838b33a5+_tune_wikitext-2_35m_lstm_mos2_d2_arms/trial_763
        "num_params": 35e6, "vocab": 33279, "tied": True, "rounds": 0, "rank": 0,
        "ratio": 0.3530770457779424, "mos": 2,
        "input_dropout": 0.6090979517941943, "inter_layer_dropout": 0.09075401405970591,
        "state_dropout": 0.2714030562283111, "output_dropout": 0.34845530389157287,
        "learning_rate": 0.003183909546336849, "l2_penalty": 0.00023063627783021125,
        "batch_size": 64, "max_time_steps": 70, "turns": 1000, "trigger_averaging_turns": 50,
        "trigger_averaging_at_the_latest": 800,
    },
}  # fmt: skip
STEPS_PER_TURN, MAX_GRAD_NORM, DROP_STATE, BETA2, EPSILON, FORGET_BIAS = 200, 10.0, 0.01, 0.999, 1e-8, 1.0


def lamb_parameters(
    hidden: int, vocab: int, rounds: int, rank: int, tied: bool, ratio: float = 1.0, mos: int = 0, layers: int = 2
) -> int:
    """Trainable parameters as lamb counts them for its budget (``lamb_flags._budget_hidden_size``).

    The embedding is ``E = round(ratio * H)`` wide (``H`` from ratio 1 up); the softmax has its weights (the
    embedding's when tied, else ``V x H``) and a bias; each layer one ``[in + H, 4H]`` matrix and one bias per gate;
    each Mogrifier round two low-rank factors and a bias (even rounds, 0-based, gate x from h; odd rounds gate h from
    x); a mixture of ``mos`` softmaxes adds the contexts' projection ``[H, mos E]`` with its bias and the prior
    ``[H, mos]`` without one.
    """
    embedding = hidden if ratio >= 1 else max(1, round(ratio * hidden))
    total = vocab * embedding + (0 if tied else vocab * hidden) + vocab
    for layer in range(layers):
        inp = embedding if layer == 0 else hidden
        total += (inp + hidden) * 4 * hidden + 4 * hidden
        for r in range(rounds):
            total += rank * (hidden + inp) + (inp if r % 2 == 0 else hidden)
    if mos:
        total += hidden * mos * embedding + mos * embedding + hidden * mos
    return total


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAMB))
def test_recipe_is_lambs_released_configuration(name: str) -> None:
    from commands.tune import full_config

    lamb = LAMB[name]
    config = full_config(ROOT / "configs" / name)
    trainer, model = config["trainer"], config["model"]["init_args"]
    data, optimizer = config["data"]["init_args"], config["optimizer"]["init_args"]
    cell = model["cell_options"]
    steps = lamb["max_time_steps"]

    assert model["architecture"] == ("mogrifier" if lamb["rounds"] else "lstm")
    assert (cell.get("rounds", 0), cell.get("rank", 0)) == (lamb["rounds"], lamb["rank"])
    assert cell.get("round_bias", False) == bool(lamb["rounds"])  # lamb's rounds have a bias each
    assert cell["cap_input_gate"] and cell["sum_layer_outputs"] and cell["forget_bias"] == FORGET_BIAS
    assert model["num_layers"] == 2 and model["input_embedding_ratio"] == lamb["ratio"]
    assert model["tie_weights"] == lamb["tied"]
    if lamb["mos"]:  # lamb drops the components' contexts at downprojected_output_dropout -1: the output dropout
        assert (model["head"], model["mos_components"]) == ("mos", lamb["mos"])
        assert model["mos_dropout"] == lamb["output_dropout"]
    else:
        assert model["head"] == "softmax"
    for dropout in ("input_dropout", "inter_layer_dropout", "output_dropout"):
        assert model[dropout] == lamb[dropout]
    assert cell["state_dropout"] == lamb["state_dropout"]
    assert model["drop_state_probability"] == DROP_STATE

    assert config["optimizer"]["class_path"] == "torch.optim.Adam"
    assert optimizer["lr"] == lamb["learning_rate"]
    assert list(optimizer["betas"]) == [0.0, BETA2] and optimizer["eps"] == EPSILON
    assert optimizer["weight_decay"] == pytest.approx(lamb["l2_penalty"] / steps, rel=1e-9)
    assert trainer["gradient_clip_val"] == pytest.approx(MAX_GRAD_NORM / steps, rel=1e-5)

    assert (data["batch_size"], data["bptt"]) == (lamb["batch_size"], steps)
    assert trainer["max_steps"] == lamb["turns"] * STEPS_PER_TURN
    assert trainer["val_check_interval"] == STEPS_PER_TURN and trainer["check_val_every_n_epoch"] is None
    [averaging] = [c for c in trainer["callbacks"] if c["class_path"].endswith("WeightAveragingOnPlateau")]
    assert averaging["init_args"]["patience"] == lamb["trigger_averaging_turns"]
    assert averaging["init_args"]["start_fraction"] == lamb["trigger_averaging_at_the_latest"] / lamb["turns"]

    # The hidden size is the largest lamb's budget rule allows.
    size = (lamb["vocab"], lamb["rounds"], lamb["rank"], lamb["tied"], lamb["ratio"], lamb["mos"])
    hidden = model["hidden_size"]
    assert lamb_parameters(hidden, *size) <= lamb["num_params"] < lamb_parameters(hidden + 1, *size)


@pytest.mark.parametrize(
    ("architecture", "cell", "ratio", "tied", "head"),
    [
        ("mogrifier", {"rounds": 5, "rank": 6, "round_bias": True}, 1.0, False, "softmax"),
        ("mogrifier", {"rounds": 6, "rank": 4, "round_bias": True}, 0.3, True, "mos"),
        ("lstm", {}, 0.5, True, "mos"),
    ],
)
def test_lamb_parameter_count_matches_the_zoo_model(
    architecture: str, cell: dict[str, Any], ratio: float, tied: bool, head: str
) -> None:
    """The count above is the zoo model's own, less the second bias vector nn.LSTM keeps per layer (its sum with the
    first is the gate's one bias): the rule counts the same network, so the solved sizes are lamb's."""
    import torch

    from zoo import RecurrentLM

    hidden, vocab, components = 40, 30, 2
    with torch.device("meta"):
        model = RecurrentLM(
            vocab_size=vocab,
            architecture=architecture,
            hidden_size=hidden,
            input_embedding_ratio=ratio,
            num_layers=2,
            tie_weights=tied,
            head=head,
            mos_components=components,
            cell_options=cell,
        )
    rounds, rank = cell.get("rounds", 0), cell.get("rank", 0)
    mos = components if head == "mos" else 0
    second_biases = 2 * 4 * hidden
    assert model.num_parameters() - second_biases == lamb_parameters(hidden, vocab, rounds, rank, tied, ratio, mos)


# The CPU-scale comparison: a Mogrifier and its LSTM twin, the paper's claim measured on one recipe.
TWINS = [
    ("ptb/mogrifier-cpu.yaml", "ptb/lstm-melis-cpu.yaml", 10_000),
    ("ptb-char/mogrifier-cpu.yaml", "ptb-char/lstm-melis-cpu.yaml", 51),
]
MOGRIFIER_ONLY = {"rounds", "rank", "round_bias"}


@pytest.mark.slow
@pytest.mark.parametrize(("mogrifier", "lstm", "vocab"), TWINS)
def test_cpu_twins_differ_in_the_cell_alone_at_one_parameter_count(mogrifier: str, lstm: str, vocab: int) -> None:
    """Everything but the cell (and the width that keeps the parameter count) is the same in the pair: data,
    batches, optimiser, schedule, dropouts, seed, epochs; and the counts agree within 0.1%, the Mogrifier's the
    largest width that stays within the LSTM's."""
    import torch

    from commands.tune import full_config
    from zoo import RecurrentLM

    configs = [full_config(ROOT / "configs" / name) for name in (mogrifier, lstm)]
    models = [c["model"]["init_args"] for c in configs]
    assert [m["architecture"] for m in models] == ["mogrifier", "lstm"]
    assert set(models[0]["cell_options"]) - set(models[1]["cell_options"]) == MOGRIFIER_ONLY
    shared = {k: v for k, v in models[0]["cell_options"].items() if k not in MOGRIFIER_ONLY}
    assert shared == models[1]["cell_options"]
    unlike = {"architecture", "hidden_size", "cell_options"}
    assert {k: v for k, v in models[0].items() if k not in unlike} == {
        k: v for k, v in models[1].items() if k not in unlike
    }
    for section in ("data", "optimizer", "lr_scheduler", "seed_everything"):
        assert configs[0][section] == configs[1][section]
    trainers = [{k: v for k, v in c["trainer"].items() if k != "default_root_dir"} for c in configs]
    assert trainers[0] == trainers[1] and trainers[0].get("max_time") is None  # the epochs, not the clock, end both

    def parameters(model: dict[str, Any], hidden: int) -> int:
        settings = {k: model[k] for k in ("architecture", "num_layers", "tie_weights", "input_embedding_ratio")}
        with torch.device("meta"):
            network = RecurrentLM(vocab_size=vocab, hidden_size=hidden, cell_options=model["cell_options"], **settings)
        return network.num_parameters()

    counts = [parameters(m, m["hidden_size"]) for m in models]
    assert abs(counts[0] - counts[1]) <= 0.001 * counts[1]
    assert counts[0] <= counts[1] < parameters(models[0], models[0]["hidden_size"] + 1)
