"""The house's layers: loading a model for inference needs no training stack, and the imports keep the layering
(docs/architecture.md) — checked by import-linter's contracts in pyproject.toml, and with no cycle between modules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINING_STACK = ("lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics", "optuna")


def _modules_after(code: str) -> set[str]:
    """The top-level modules a fresh interpreter has imported after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted({{name.split('.')[0] for name in sys.modules}})))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300
    ).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


@pytest.mark.slow
def test_loading_a_pretrained_model_imports_no_training_stack() -> None:
    loaded = _modules_after(
        "from checkpoints import from_pretrained\n"
        "model, tokenizer = from_pretrained('ptb-lstm-small')\n"
        "assert type(model).__name__ == 'RecurrentLM' and tokenizer.vocab_size == 10000"
    )
    assert "zoo" in loaded and "torch" in loaded  # the probe ran
    assert not loaded & set(TRAINING_STACK), sorted(loaded & set(TRAINING_STACK))


@pytest.mark.slow
def test_the_zoo_imports_no_training_stack() -> None:
    loaded = _modules_after("import zoo\nzoo.build('lstm', 4, 4)\nimport datamodules.tokenizers")
    assert not loaded & set(TRAINING_STACK), sorted(loaded & set(TRAINING_STACK))


@pytest.mark.slow
def test_scoring_a_text_model_imports_no_training_stack() -> None:
    """lm-zoo evaluate, score and generate of a text model read its corpus through datamodules.TextData, the data
    module without Lightning, whose import cost more than scoring a small model (docs/results.md). A bundled model
    needs no Hub client either: huggingface_hub's HTTP stack cost every command ~0.14-0.25 s of start-up."""
    loaded = _modules_after(  # LM_ZOO_DATA comes from this process (tests/conftest.py sets it)
        "import cli\n"
        "argv = ['evaluate', 'synthetic-xml-lstm', '--split', 'test', '--device', 'cpu', '--max-tokens', '5000']\n"
        "assert cli.main(argv) == 0\n"
        "assert cli.main(['generate', 'ptb-lstm-small', '--num-samples', '1', '--max-tokens', '3']) == 0"
    )
    assert "zoo" in loaded and "datamodules" in loaded  # the probe ran
    assert not loaded & set(TRAINING_STACK), sorted(loaded & set(TRAINING_STACK))
    assert "huggingface_hub" not in loaded


def test_lm_zoo_help_imports_no_torch() -> None:
    loaded = _modules_after("import cli\ncli._usage()")
    assert "torch" not in loaded and "lightning" not in loaded


def test_the_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 kept, 0 broken" in result.stdout


def _cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm): each holds an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in imports.get(module, ()):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(imports):
        if module not in index:
            visit(module)
    return found


def test_tarjan_finds_a_cycle_and_only_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "d": {"a"}}) == []


def test_no_module_imports_itself_through_others() -> None:
    import grimp

    packages = ("zoo", "datamodules", "lightning_modules", "checkpoints", "commands")
    graph = grimp.build_graph(*packages, cache_dir=None)
    internal = {module for module in graph.modules if module.split(".")[0] in packages}
    imports = {module: graph.find_modules_directly_imported_by(module) & internal for module in internal}
    assert sum(map(len, imports.values())) > 100  # the graph was read
    assert _cycles(imports) == []


@pytest.mark.slow
def test_a_missing_optional_package_is_one_line_naming_its_extra() -> None:
    # None in sys.modules makes `import nltk` fail as an absent package does (ModuleNotFoundError, name "nltk").
    probe = "import sys\nsys.modules['nltk'] = None\nimport cli\nsys.exit(cli.main(['parse', 'ptb-on-lstm']))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        'lm-zoo: error: this needs nltk, which is not installed: pip install "lm-zoo[parse]"'
    ]


def test_the_long_library_functions_only_get_fewer() -> None:
    """``benchmarks/house.py``'s count of library functions of 60 lines or more stays at or under its ceiling, which
    is lowered as functions are split."""
    from benchmarks.house import LONG_FUNCTIONS_AT_MOST, long_functions

    rows = long_functions()
    assert len(rows) <= LONG_FUNCTIONS_AT_MOST, "\n".join(f"{n} {place} {name}" for n, place, name in rows)
    assert all(lines >= 60 for lines, _, _ in rows) and long_functions(at_least=1)  # it reads the library


def test_the_library_repeats_itself_only_less(tmp_path: Path) -> None:
    """``benchmarks/house.py``'s count of pairs of places in the library that share six or more lines stays at or
    under its ceiling; and the count finds a repeat, where it starts, and ignores imports and closing brackets."""
    from benchmarks.house import REPEATED_PAIRS_AT_MOST, repeated_code

    pairs = repeated_code()
    assert len(pairs) <= REPEATED_PAIRS_AT_MOST, "\n".join(f"{n} {a} {b}" for n, a, b in pairs)
    body = "".join(f"    total = total + {i}  # step {i}\n" for i in range(7))
    (tmp_path / "zoo").mkdir()
    (tmp_path / "zoo" / "a.py").write_text(f"import torch\n\n\ndef f(total):\n{body}    return total\n")
    (tmp_path / "zoo" / "b.py").write_text(
        f"import torch\nfrom torch import nn\n\n\ndef g(total):\n    (\n    )\n{body}"
    )
    assert repeated_code(tmp_path) == [(7, "zoo/a.py:5", "zoo/b.py:8")]


def test_no_library_module_parses_arguments() -> None:
    """argparse belongs to the command layer (``commands/``, ``cli.py``): a scoring procedure declares its flags as
    data (``evaluation.scoring.Flag``), and no other library package imports argparse."""
    import ast

    from benchmarks.house import LIBRARY

    parsing = []
    for package in (name for name in LIBRARY if name != "commands"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if "argparse" in names or (isinstance(node, ast.ImportFrom) and node.module == "argparse"):
                    parsing.append(str(path.relative_to(ROOT)))
    assert not parsing


LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


def _private_lightning_names(cls: type) -> list[str]:
    """The private names (``_x``) that ``cls``, a class built on a Lightning class, defines or reads through ``self``
    or ``super()`` and that a Lightning base defines (a method, or an attribute its ``__init__`` sets), unless one of
    lm-zoo's own bases (a mixin of ``lightning_private.py``) does."""
    import inspect
    import re

    lightning = [base for base in cls.__mro__ if base.__module__.split(".")[0] in LIGHTNING]
    ours = [base for base in cls.__mro__[1:] if base not in lightning and base is not object]
    named = set(re.findall(r"\b(?:self|super\(\))\.(_[a-z]\w*)", inspect.getsource(cls)))
    named |= {name for name in vars(cls) if name.startswith("_") and not name.startswith("__")}
    sources = [inspect.getsource(base) for base in lightning]

    def lightnings(name: str) -> bool:
        return any(name in vars(base) for base in lightning) or any(re.search(rf"\bself\.{name}\b", s) for s in sources)

    return sorted(n for n in named if lightnings(n) and not any(n in vars(base) for base in ours))


def test_private_lightning_apis_are_used_in_lightning_private_alone() -> None:
    """docs/architecture.md: every use of a private Lightning API is a function or mixin of
    ``lightning_modules/lightning_private.py``, which says why no public one serves. No library class built on a
    Lightning class (a callback, the CLI, the progress bar, a module) overrides or reads a private name of its
    Lightning bases, and no library file reaches into a Lightning object's private attribute."""
    import importlib
    import inspect
    import pkgutil
    import re

    from lightning.pytorch.callbacks import ModelCheckpoint

    from benchmarks.house import LIBRARY

    class Leaky(ModelCheckpoint):  # what the check must catch
        def save_now(self, trainer) -> None:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    assert _private_lightning_names(Leaky) == ["_monitor_candidates", "_save_last_checkpoint"]
    uses = []
    for package in (name for name in LIBRARY if (ROOT / name).is_dir()):
        modules = [package] + [f"{package}.{m.name}" for m in pkgutil.iter_modules([str(ROOT / package)])]
        for name in modules:
            for cls in vars(importlib.import_module(name)).values():
                if inspect.isclass(cls) and cls.__module__ == name and name != "lightning_modules.lightning_private":
                    if any(base.__module__.split(".")[0] in LIGHTNING for base in cls.__mro__):
                        uses += [f"{name}.{cls.__name__}.{n}" for n in _private_lightning_names(cls)]
    reaching = re.compile(r"\b(?:trainer|pl_module|strategy|fit_loop|epoch_loop|_logger_connector)\._[a-z]")
    for path in sorted(p for package in LIBRARY for p in (ROOT / package).rglob("*.py")):
        if path.name != "lightning_private.py":
            uses += [
                f"{path.relative_to(ROOT)}: {line.strip()}"
                for line in path.read_text(encoding="utf-8").splitlines()
                if reaching.search(line)
            ]
    assert uses == []
