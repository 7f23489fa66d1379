"""The search space file: which config keys to tune within which ranges, the objective and the pruner.

    objective: {metric: eval/top1, direction: max}   # default: the recipe's checkpoint.best_metric and best_mode
    pruner: median                                    # or {name: median, n_startup_trials: 5}; halving, hyperband, none
    params:
      optim.lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}
      optim.weight_decay: {type: float, low: 0.0, high: 0.1}
      trainer.batch_size: {type: int, low: 32, high: 256, step: 32}
      optim.name: {type: choice, values: [adamw, sgd]}

Everything is checked before any trial starts: the file's structure and ranges here, then every
key and value against the recipe's schema, by composing the recipe's config with the search's
overrides and each end of each range and each choice (``common.entry.compose_config``). A key the
recipe does not have, or a value of the wrong type, is then one line, not a failed trial.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.entry import CONF_DIR, compose_config
from common.errors import UserError
from common.run.search_trial import PRUNERS, make_pruner

PRESETS = Path(CONF_DIR) / "search"
TOP_LEVEL = ("objective", "pruner", "params")
FIELDS = {"float": ("low", "high", "log", "step"), "int": ("low", "high", "log", "step"), "choice": ("values",)}
DIRECTIONS = {"max": "maximize", "min": "minimize"}
DEFAULT_PRUNER = {"name": "median"}
# The search names each trial's run directory and keeps all of a trial's outputs in it; a trial
# must resume its own checkpoints.
RESERVED_KEYS = ("run_dir", "name", "checkpoint.dir", "logging.dir", "checkpoint.resume")


@dataclass(frozen=True)
class Param:
    """One tuned config key: a ``float`` or ``int`` range (``log``, ``step``) or a ``choice``."""

    key: str
    type: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    values: tuple[Any, ...] = ()

    def distribution(self) -> Any:
        """The Optuna distribution the sampler draws this parameter from."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.type == "float":
            return FloatDistribution(self.low, self.high, log=self.log, step=self.step)
        if self.type == "int":
            return IntDistribution(self.low, self.high, log=self.log, step=self.step or 1)
        return CategoricalDistribution(self.values)

    def override(self, value: Any) -> str:
        """``key=value`` as a Hydra override (floats in Python's shortest exact form)."""
        if isinstance(value, bool):
            text = str(value).lower()
        elif value is None:
            text = "null"
        elif isinstance(value, float):
            text = repr(value)
        else:
            text = str(value)
        return f"{self.key}={text}"

    def extremes(self) -> tuple[Any, ...]:
        """The values that check this parameter against the schema: both ends, or every choice."""
        return self.values if self.type == "choice" else (self.low, self.high)

    def describe(self) -> dict[str, Any]:
        """The parameter as the space file writes it (for the study's record of its settings)."""
        if self.type == "choice":
            return {"type": "choice", "values": list(self.values)}
        spec = {"type": self.type, "low": self.low, "high": self.high}
        if self.log:
            spec["log"] = True
        if self.step is not None:
            spec["step"] = self.step
        return spec


@dataclass(frozen=True)
class Space:
    """A search space file, checked (see the module). ``objective`` is None when the file leaves
    it to the recipe's ``checkpoint.best_metric`` and ``best_mode``."""

    path: Path
    params: tuple[Param, ...]
    objective: dict[str, str] | None
    pruner: dict[str, Any]


def space_file(name: str | None, recipe: str) -> Path:
    """The space file ``name`` names: a path, or a preset in ``conf/search/`` (default: the recipe's)."""
    name = name or recipe
    for candidate in (Path(name), PRESETS / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    presets = ", ".join(sorted(path.stem for path in PRESETS.glob("*.yaml"))) or "none"
    raise UserError(f"no search space {name!r}: not a file, nor a preset in {PRESETS} (presets: {presets})")


def _number(path: Path, where: str, name: str, value: Any, integer: bool) -> float | int:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        hint = " (YAML reads 1e-4 as text: write 1.0e-4)" if isinstance(value, str) else ""
        raise UserError(f"{path}: {where}: {name} must be {'an integer' if integer else 'a number'}, "
                        f"not {value!r}{hint}")
    return value if integer else float(value)


def _param(path: Path, key: str, spec: Any) -> Param:
    """One entry of ``params``, its structure and range checked."""
    where = f"params.{key}"
    if not isinstance(spec, dict) or spec.get("type") not in FIELDS:
        raise UserError(f"{path}: {where} must be a mapping with type: float, int or choice")
    kind = spec["type"]
    unknown = sorted(set(spec) - {"type", *FIELDS[kind]})
    if unknown:
        raise UserError(f"{path}: {where}: unknown field {', '.join(unknown)} (a {kind} has "
                        f"{', '.join(FIELDS[kind])})")
    if kind == "choice":
        values = spec.get("values")
        if not isinstance(values, list) or not values:
            raise UserError(f"{path}: {where}: values must be a non-empty list")
        for value in values:
            if value is not None and not isinstance(value, (str, int, float, bool)):
                raise UserError(f"{path}: {where}: a choice must be a number, a string, true, false or null, "
                                f"not {value!r} (write a list as a string: '[4,8]')")
        if len(set(map(repr, values))) != len(values):
            raise UserError(f"{path}: {where}: values repeats a choice")
        return Param(key, kind, values=tuple(values))
    integer = kind == "int"
    for name in ("low", "high"):
        if name not in spec:
            raise UserError(f"{path}: {where}: {name} is missing")
    low, high = (_number(path, where, name, spec[name], integer) for name in ("low", "high"))
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise UserError(f"{path}: {where}: log must be true or false, not {log!r}")
    step = spec.get("step")
    if step is not None:
        step = _number(path, where, "step", step, integer)
    if not low < high:
        raise UserError(f"{path}: {where}: low ({low}) must be below high ({high})")
    if log and low <= 0:
        raise UserError(f"{path}: {where}: a log range must start above 0, not at {low}")
    if step is not None:
        if step <= 0:
            raise UserError(f"{path}: {where}: step must be positive, not {step}")
        if log:
            raise UserError(f"{path}: {where}: a log range takes no step")
        multiple = (high - low) / step
        if abs(multiple - round(multiple)) > 1e-9 * max(1.0, multiple):
            raise UserError(f"{path}: {where}: high ({high}) must be low ({low}) plus a multiple of step ({step})")
    return Param(key, kind, low=low, high=high, log=log, step=step)


def _objective(path: Path, spec: Any) -> dict[str, str]:
    if not isinstance(spec, dict) or set(spec) != {"metric", "direction"}:
        raise UserError(f"{path}: objective must be {{metric: <a metric the evaluation reports>, direction: max or "
                        f"min}}")
    if not isinstance(spec["metric"], str) or not spec["metric"]:
        raise UserError(f"{path}: objective.metric must be a metric name such as eval/top1")
    if spec["direction"] not in DIRECTIONS:
        raise UserError(f"{path}: objective.direction must be max or min, not {spec['direction']!r}")
    return {"metric": spec["metric"], "direction": spec["direction"]}


def _pruner(path: Path, spec: Any) -> dict[str, Any]:
    pruner = {"name": spec} if isinstance(spec, str) else spec
    if not isinstance(pruner, dict) or "name" not in pruner:
        raise UserError(f"{path}: pruner must be one of {', '.join(PRUNERS)}, or a mapping with its name and options")
    try:
        make_pruner(pruner)
    except UserError as error:
        raise UserError(f"{path}: {error}") from error
    return dict(pruner)


def load_space(path: Path) -> Space:
    """Read and check a space file's structure and ranges (not yet against a recipe)."""
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (OSError, OmegaConfBaseException, ValueError) as error:
        raise UserError(f"{path}: not a readable YAML file: {str(error).splitlines()[0]}") from error
    if not isinstance(data, dict):
        raise UserError(f"{path}: must be a mapping with params (and optionally objective, pruner)")
    unknown = sorted(set(data) - set(TOP_LEVEL))
    if unknown:
        raise UserError(f"{path}: unknown key {', '.join(unknown)} (a space has {', '.join(TOP_LEVEL)})")
    params = data.get("params")
    if not isinstance(params, dict) or not params:
        raise UserError(f"{path}: params must map at least one config key to its range")
    objective = _objective(path, data["objective"]) if "objective" in data else None
    pruner = _pruner(path, data.get("pruner", DEFAULT_PRUNER["name"]))
    return Space(path, tuple(_param(path, str(key), spec) for key, spec in params.items()), objective, pruner)


def override_key(override: str) -> str:
    """The config key an override sets: ``optim.lr`` for ``optim.lr=0.1``, ``++optim.lr=0.1`` or ``~optim.lr``."""
    return override.split("=", 1)[0].lstrip("+~")


def check_against_recipe(space: Space, recipe: str, overrides: list[str]) -> dict[str, str]:
    """Check ``overrides`` and every parameter's values against ``recipe``'s schema (see the
    module); return the objective, the recipe's ``checkpoint.best_metric`` and ``best_mode`` when
    the space sets none."""
    for override in overrides:
        if override_key(override) in RESERVED_KEYS:
            raise UserError(f"{override}: the search sets {override_key(override)} for each trial "
                            f"(its run directory is <study>/trial_<n>/)")
    given = {override_key(override) for override in overrides}
    for param in space.params:
        if param.key in RESERVED_KEYS:
            raise UserError(f"{space.path}: params.{param.key}: the search sets {param.key} for each trial")
        if param.key in given:
            raise UserError(f"{space.path}: params.{param.key} is also set by the overrides: set it in one place")
    cfg = compose_config(recipe, overrides)
    for param in space.params:
        for value in param.extremes():
            try:
                compose_config(recipe, [*overrides, param.override(value)])
            except UserError as error:
                raise UserError(f"{space.path}: params.{param.key} = {value!r}: {error}") from error
    if space.objective is not None:
        return space.objective
    mode = cfg.checkpoint.best_mode
    return {"metric": cfg.checkpoint.best_metric, "direction": getattr(mode, "value", mode)}
