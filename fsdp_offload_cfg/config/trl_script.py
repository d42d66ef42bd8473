"""What a training script of the user's own says of the TRL run it builds, read from its source.

TRL's quickstart is a script with everything in it: `SFTTrainer(model="Qwen/Qwen2.5-0.5B",
args=SFTConfig(max_length=2048, ...), peft_config=LoraConfig(r=16))`. Launched as `accelerate launch
train.py`, its command line holds nothing, and TRL's configs hold defaults the Trainer does not
(bf16 unless fp16, every layer checkpointed, `max_length` 1024). The estimate of such a run read
it as the Trainer's: float32, no checkpointing, and asked for the model, the length and the batch
the script states.

Read here, nothing run (the script may need GPUs, data, a login), from the script's syntax tree:
- the trainer: the first call of one of TRL's trainers (`TRL_TRAINERS`), by any name the script
  gives it (`from trl import X as Y`, `trl.X` after `import trl`, a subclass of the script's own);
- its arguments' class, whose defaults hold: the TRL config its `args=` is built from (a call,
  or a name assigned one), TRL's own where it has no `args=` (the trainer builds its config), else
  the one the script names (a parser's: `TrlParser((SFTConfig, ModelConfig))`); `TrainingArguments`
  where the script names that and no TRL config (TRL converts it, keeping the Trainer's values);
- whether it names TRL's `ModelConfig`, whose `dtype` loads the model as TRL's own scripts do;
- literal values only: the config call's keywords, the trainer's model (a string, or a name
  assigned one or a `from_pretrained("...")` call, whose `dtype` counts) and its `peft_config=`
  LoraConfig (PEFT's defaults: r 8, dropout 0), and GRPO's and RLOO's reward models among its
  `reward_funcs=` (the strings: a function is no model). A keyword whose value is not a literal
  is named in `unread`: the estimate says so, and takes it from the command line or its flags.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# TRL's trainers a script of the user's own may build, and the verb whose trainer each is
TRL_TRAINERS = {"SFTTrainer": "sft", "DPOTrainer": "dpo", "KTOTrainer": "kto", "GRPOTrainer": "grpo",
                "RLOOTrainer": "rloo", "DistillationTrainer": "distillation"}
TRL_CONFIGS = {"SFTConfig": "sft", "DPOConfig": "dpo", "KTOConfig": "kto", "GRPOConfig": "grpo", "RLOOConfig": "rloo",
               "DistillationConfig": "distillation"}
TRAINING_ARGUMENTS = "TrainingArguments"
_PACKAGES = ("trl", "transformers", "peft", "torch")
_DTYPE_KEYWORDS = ("dtype", "torch_dtype")
_TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
                 "float": "float32", "float64": "float64", "double": "float64"}  # torch's attribute: the dtype's name


@dataclass(frozen=True)
class TrlScript:
    """The TRL run a script builds (module docstring)."""

    script: str  # as the launch command names it
    trainer: str  # TRL's trainer class (`SFTTrainer`)
    config: str  # the arguments' class whose defaults hold: a TRL config (`SFTConfig`) or `TrainingArguments`
    config_from: str  # in words, where `config` was told from
    arguments: dict[str, Any] = field(default_factory=dict)  # training arguments the script states as literals
    unread: tuple[str, ...] = ()  # keywords of those calls whose values are not literals
    # the script names TRL's ModelConfig, as TRL's own scripts do: its `dtype` (float32 unset) loads the model
    model_config: bool = False
    model_by_name: bool = False  # the trainer is given its model as a string: TRL loads it (`trl_defaults.py`)

    @property
    def verb(self) -> str:
        return TRL_TRAINERS[self.trainer]

    @property
    def trl_defaults(self) -> bool:
        """TRL's config defaults hold (bf16, checkpointing, its lengths), not the Trainer's."""
        return self.config != TRAINING_ARGUMENTS


def read_trl_script(script: str, cwd: str) -> TrlScript | None:
    """The TRL run `script` (relative to `cwd`) builds; None where it builds none of TRL's
    trainers, or cannot be read."""
    try:
        tree = ast.parse(Path(cwd, script).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    names = _Names(tree)
    tree = _TorchDtypes(names.torch).visit(tree)
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    trainer_call = next((c for c in calls if names.of(c.func, TRL_TRAINERS)), None)
    if trainer_call is None:
        return None
    trainer = names.of(trainer_call.func, TRL_TRAINERS)
    assigned = _assignments(tree)
    config, config_from, config_call = _config(trainer, trainer_call, names, assigned, tree)
    arguments: dict[str, Any] = {}
    unread: list[str] = []
    if config_call is not None:
        _literal_keywords(config_call, arguments, unread)
    model_by_name = _model(trainer_call, names, assigned, arguments, unread)
    _lora(trainer_call, names, assigned, arguments, unread)
    if TRL_TRAINERS[trainer] in ("grpo", "rloo"):
        _reward_models(trainer_call, assigned, arguments)
    return TrlScript(script, trainer, config, config_from, arguments, tuple(unread),
                     model_config=names.named(tree, ("ModelConfig",)) is not None, model_by_name=model_by_name)


class _Names:
    """The script's names for classes of TRL, transformers, PEFT and torch: imported under any alias,
    reached through a module (`trl.SFTTrainer` after `import trl`), or a class of the script's own
    derived from one (`class MyTrainer(SFTTrainer)`), each as the class it is."""

    def __init__(self, tree: ast.AST) -> None:
        self.classes: dict[str, str] = {}  # the script's name: the library's
        self.modules: set[str] = set()  # the script's names for those libraries' modules
        self.torch: set[str] = set()  # its names for torch itself (`import torch`, `import torch as t`)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _PACKAGES:
                self.classes.update({a.asname or a.name: a.name for a in node.names})
            elif isinstance(node, ast.Import):
                self.modules.update(a.asname or a.name.split(".")[0] for a in node.names
                                    if a.name.split(".")[0] in _PACKAGES)  # fmt: skip
                self.torch.update(a.asname or "torch" for a in node.names if a.name == "torch" or
                                  (a.asname is None and a.name.startswith("torch.")))  # fmt: skip
        for node in ast.walk(tree):  # as often as a class derives from one found before it
            if isinstance(node, ast.ClassDef):
                base = next(filter(None, (self.of(b) for b in node.bases)), None)
                if base is not None:
                    self.classes[node.name] = base

    def of(self, expression: ast.expr, among: dict[str, str] | tuple[str, ...] | None = None) -> str | None:
        """The library's class `expression` names, where it is one `among` those given."""
        if isinstance(expression, ast.Name):
            found = self.classes.get(expression.id)
        elif isinstance(expression, ast.Attribute) and _root_name(expression) in self.modules:
            found = expression.attr
        else:
            found = None
        return found if found is not None and (among is None or found in among) else None

    def named(self, tree: ast.AST, among: dict[str, str] | tuple[str, ...]) -> str | None:
        """The first of `among` the script refers to anywhere (a parser's dataclasses, too)."""
        nodes = sorted((n for n in ast.walk(tree) if isinstance(n, (ast.Name, ast.Attribute))),
                       key=lambda n: (n.lineno, n.col_offset))  # fmt: skip
        return next(filter(None, (self.of(n, among) for n in nodes)), None)


def _root_name(expression: ast.expr) -> str | None:
    while isinstance(expression, ast.Attribute):
        expression = expression.value
    return expression.id if isinstance(expression, ast.Name) else None


def _assignments(tree: ast.AST) -> dict[str, ast.expr]:
    """Each plain name assigned once, and its value (`args = SFTConfig(...)`). A name assigned
    twice (`peft_config = LoraConfig(...)` under an `if`, `None` under its `else`) has no one value
    the source states: left out, as is anything bound otherwise (a loop, a parser's result)."""
    found: dict[str, ast.expr | None] = {}
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.NamedExpr)) else []
        value = getattr(node, "value", None) if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        for target in targets:
            if isinstance(target, ast.Name):
                found[target.id] = value if target.id not in found else None
    return {name: value for name, value in found.items() if value is not None}


class _TorchDtypes(ast.NodeTransformer):
    """`torch.bfloat16` (under the script's name for torch) as the literal `"bfloat16"`, wherever
    a value holds one (`model_init_kwargs={"dtype": torch.bfloat16}`), as TRL and transformers
    take either."""

    def __init__(self, torch_names: set[str]) -> None:
        self.torch_names = torch_names

    def visit_Attribute(self, node: ast.Attribute) -> ast.expr:
        if isinstance(node.value, ast.Name) and node.value.id in self.torch_names and node.attr in _TORCH_DTYPES:
            return ast.copy_location(ast.Constant(_TORCH_DTYPES[node.attr]), node)
        return self.generic_visit(node)


def _argument(call: ast.Call, keyword: str, position: int | None = None) -> ast.expr | None:
    for k in call.keywords:
        if k.arg == keyword:
            return k.value
    return call.args[position] if position is not None and len(call.args) > position else None


def _resolved(expression: ast.expr | None, assigned: dict[str, ast.expr]) -> ast.expr | None:
    """`expression`, or the value a name in it was assigned (one step: `args = SFTConfig(...)`)."""
    if isinstance(expression, ast.Name) and expression.id in assigned:
        return assigned[expression.id]
    return expression


def _config(trainer: str, call: ast.Call, names: _Names, assigned: dict[str, ast.expr],
            tree: ast.AST) -> tuple[str, str, ast.Call | None]:
    """The arguments' class, where it was told from, and the call that builds it (where the script has one)."""
    given = _argument(call, "args")
    built = _resolved(given, assigned)
    if isinstance(built, ast.Call) and (cls := names.of(built.func, (*TRL_CONFIGS, TRAINING_ARGUMENTS))):
        return cls, f"its args= {cls}(...)", built
    own = next(c for c, verb in TRL_CONFIGS.items() if verb == TRL_TRAINERS[trainer])
    if given is None:
        return own, f"no args=: {trainer} builds its own {own}", None
    if named := names.named(tree, TRL_CONFIGS):
        return named, f"the script names {named}", None
    if names.named(tree, (TRAINING_ARGUMENTS,)):
        return TRAINING_ARGUMENTS, f"the script names {TRAINING_ARGUMENTS} and no TRL config", None
    return own, f"its args= cannot be told from the source: {own} assumed", None


def _literal(expression: ast.expr) -> tuple[bool, Any]:
    """(True, value) for a literal (`2048`, `"cosine"`, `{"dtype": "bfloat16"}`), else (False, None)."""
    try:
        return True, ast.literal_eval(expression)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _literal_keywords(call: ast.Call, arguments: dict[str, Any], unread: list[str], prefix: str = "") -> None:
    for k in call.keywords:
        if k.arg is None:  # **kwargs
            unread.append(f"{prefix}**{ast.unparse(k.value)}")
            continue
        ok, value = _literal(k.value)
        if ok:
            arguments[k.arg] = value
        else:
            unread.append(f"{prefix}{k.arg}")


def _model(call: ast.Call, names: _Names, assigned: dict[str, ast.expr], arguments: dict[str, Any],
           unread: list[str]) -> bool:
    """The trainer's model (and DistillationTrainer's teacher), where the source states it; whether
    the model is given by name (a string TRL loads, not a model the script loaded)."""
    given = _argument(call, "model", 0)
    path, dtype = _loaded(given, names, assigned)
    if path is not None:
        arguments["model_name_or_path"] = path
        if dtype is not None:
            arguments["dtype"] = dtype
    elif given is not None:
        unread.append("model")
    teacher = _argument(call, "teacher_model", 1) if names.of(call.func) == "DistillationTrainer" else None
    path, dtype = _loaded(teacher, names, assigned)
    if path is not None:
        arguments["teacher_model_name_or_path"] = path
        if dtype is not None:
            arguments["teacher_model_init_kwargs"] = {"dtype": dtype}
    elif teacher is not None:
        unread.append("teacher_model")
    return isinstance(model := _resolved(given, assigned), ast.Constant) and isinstance(model.value, str)


def _loaded(given: ast.expr | None, names: _Names, assigned: dict[str, ast.expr]) -> tuple[str | None, str | None]:
    """A model's path and dtype where the source states them: a string, or a name assigned one, or
    `X.from_pretrained("...")` (with its `dtype`), directly or through a name."""
    model = _resolved(given, assigned)
    dtype = None
    if isinstance(model, ast.Call) and isinstance(model.func, ast.Attribute) and model.func.attr == "from_pretrained":
        dtype = next((d for k in model.keywords if k.arg in _DTYPE_KEYWORDS and (d := _dtype(k.value))), None)
        model = _resolved(_argument(model, "pretrained_model_name_or_path", 0), assigned)
    ok, value = _literal(model) if model is not None else (False, None)
    return (value, dtype) if ok and isinstance(value, str) else (None, None)


def _dtype(expression: ast.expr) -> str | None:
    """`"bfloat16"` (or `torch.bfloat16`, made a literal by `_TorchDtypes`): the dtype's name (`auto` too)."""
    ok, value = _literal(expression)
    return value if ok and isinstance(value, str) else None


def _reward_models(call: ast.Call, assigned: dict[str, ast.expr], arguments: dict[str, Any]) -> None:
    """GRPO's and RLOO's `reward_funcs=`: a string is a model the trainer loads (a sequence
    classifier, whole on every rank), as `trl grpo`'s `reward_model_name_or_path`; a function is none."""
    given = _resolved(_argument(call, "reward_funcs", 1), assigned)
    items = given.elts if isinstance(given, (ast.List, ast.Tuple)) else [given] if given is not None else []
    paths = [value for item in items for ok, value in [_literal(_resolved(item, assigned))] if ok and isinstance(value, str)]
    if paths:
        arguments["reward_model_name_or_path"] = paths[0] if len(paths) == 1 else paths


def _lora(call: ast.Call, names: _Names, assigned: dict[str, ast.expr], arguments: dict[str, Any],
          unread: list[str]) -> None:
    """The trainer's `peft_config=` LoraConfig, as TRL's ModelConfig keys, PEFT's defaults where
    it says nothing (r 8, dropout 0, its per-model target modules)."""
    peft = _resolved(_argument(call, "peft_config"), assigned)
    if not (isinstance(peft, ast.Call) and names.of(peft.func, ("LoraConfig",))):
        if peft is not None and not (isinstance(peft, ast.Constant) and peft.value is None):
            unread.append("peft_config")
        return
    said: dict[str, Any] = {}
    _literal_keywords(peft, said, unread, prefix="LoraConfig.")
    given = {k.arg for k in peft.keywords}
    arguments["use_peft"] = True
    for keyword, key, peft_default in (("r", "lora_r", 8), ("lora_dropout", "lora_dropout", 0.0),
                                       ("target_modules", "lora_target_modules", None), ("use_dora", "use_dora", False),
                                       ("modules_to_save", "lora_modules_to_save", None)):
        if said.get(keyword) is not None:
            arguments[key] = said[keyword]
        elif keyword not in given and peft_default is not None:  # not a literal: the command line's, if any
            arguments[key] = peft_default
