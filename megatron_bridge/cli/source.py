"""Building the config a command works on: a recipe (with its options) or a YAML file, then the
YAML file's values and the `KEY=VALUE` overrides."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from megatron_bridge.cli import recipe_loader
from megatron_bridge.cli.errors import UsageError, config_errors_are_usage_errors
from megatron_bridge.config.errors import ConfigValidationError
from megatron_bridge.config.overrides import process_config_with_overrides
from megatron_bridge.config.paths import file_kind
from megatron_bridge.config.serialization import field_of
from megatron_bridge.runtime.checkpointing import layout

if TYPE_CHECKING:
    from megatron_bridge.training.config import ConfigContainer

YAML_SUFFIXES = (".yaml", ".yml")


def config_class() -> type:
    """`ConfigContainer`, imported when first needed: it loads megatron-core, which `--help` and
    the refusals of bad arguments do without."""
    from megatron_bridge.training.config import ConfigContainer

    return ConfigContainer


def get_recipe(name: str) -> Callable[..., "ConfigContainer"]:
    """The recipe function `name` (a library name, `module.path:function` or
    `path/to/file.py:function`); an unknown name is a `UsageError` naming the closest ones."""
    return recipe_loader.load(name)


def recipe_options(fn: Callable[..., Any], assignments: Sequence[str] = (), values: Optional[dict] = None) -> Any:
    """The options object of recipe `fn` with its defaults, then `KEY=VALUE` texts applied (each
    value decoded against the option's declared type, with the grammar and checks of config
    overrides), then `values` as given. Fields changed here count as set (`explicit_fields()`)."""
    options_class = getattr(fn, "options_class", None)
    if options_class is None:
        raise UsageError(f"recipe {fn.__name__} takes no options")
    _refuse_config_keys(fn, options_class, assignments)
    options = options_class(**fn.defaults)
    for name in options.explicit_fields():  # start from the recipe's defaults, none set yet
        options.mark_explicit(name, False)
    with config_errors_are_usage_errors(f"options of recipe {fn.__name__}: "):
        if assignments:
            process_config_with_overrides(options, None, list(assignments))
        for name, value in (values or {}).items():
            setattr(options, name, value)  # type-checked
    return options


def _refuse_config_keys(fn: Callable[..., Any], options_class: type, assignments: Sequence[str]) -> None:
    """`--recipe-arg model.num_layers=3` names a config field, not a recipe option: a `UsageError`
    saying to give it as an override."""
    sections = {f.name for f in dataclasses.fields(config_class())}
    for text in assignments:
        head = str(text).lstrip("+~").partition("=")[0].strip().split(".")[0]
        if head in sections and field_of(options_class, head) is None:
            raise UsageError(
                f"--recipe-arg {text}: {head!r} is a section of the config, not an option of recipe {fn.__name__} "
                f"(give it as an override, without --recipe-arg: {text}; `--help-config options` lists the options)"
            )


def recipe_kwargs(fn: Callable[..., Any], assignments: Sequence[str] = (), values: Optional[dict] = None) -> dict:
    """Keyword arguments for recipe `fn`: the options `recipe_options` sets."""
    if not assignments and not values:
        return {}
    options = recipe_options(fn, assignments, values)
    return {name: getattr(options, name) for name in options.explicit_fields()}


def check_file(path: str) -> None:
    """A `UsageError` unless `path` is a regular file, saying what it is instead (for a run or
    checkpoint directory, the config it saved)."""
    if not os.path.isfile(path):
        kind = file_kind(path)
        what = "does not exist" if kind == "missing" else f"is {kind}, not a YAML file"
        saved = saved_run_config(path) if kind != "missing" else None
        hint = f"; the config that run saved is {saved!r}" if saved else ""
        raise UsageError(f"config file {path!r} {what}{hint}")


def saved_run_config(path: str) -> Optional[str]:
    """The run_config.yaml of the latest checkpoint in directory `path` (a checkpoint directory,
    an iteration, or a run directory with `checkpoints/`), or None."""
    for root in (path, layout.checkpoint_below(path)):
        if root is None:
            continue
        try:
            directory, _ = layout.resolve(root)
        except (OSError, ValueError):
            continue
        found = os.path.join(directory, layout.RUN_CONFIG_FILE)
        if os.path.isfile(found):
            return found
    return None


def _complete_config(path: str) -> "ConfigContainer":
    """The complete config in file `path`; a file of a few sections (made to merge over a recipe)
    is a `UsageError` that says to name the recipe."""
    try:
        return config_class().from_yaml(path)
    except ConfigValidationError as exc:
        missing = [p.path for p in exc.problems if "is required by ConfigContainer but missing" in p.message]
        if not missing:
            raise
        raise UsageError(
            f"config file {path!r} is not a complete config (it lacks {', '.join(missing)}): to merge it over a "
            "recipe, add --recipe NAME (`mbridge recipes` lists them); a complete file is what a run saves "
            "(checkpoints/iter_*/run_config.yaml) or cfg.to_yaml() writes"
        ) from exc


def build_config(
    recipe: Optional[str] = None,
    recipe_args: Sequence[str] = (),
    recipe_values: Optional[dict] = None,
    config_file: Optional[str] = None,
    overrides: Sequence[str] = (),
) -> "ConfigContainer":
    """The recipe's config (called with `recipe_args`) or, without a recipe, the full config in
    `config_file`; then `config_file` (over the recipe) and `overrides` applied. Not resolved.
    `recipe_values` are recipe options given as Python values (the --dir/--name shortcuts)."""
    if recipe is None and config_file is None:
        raise UsageError("give --recipe NAME or --config-file FILE.yaml (`mbridge recipes` lists the recipes)")
    if (recipe_args or recipe_values) and recipe is None:
        raise UsageError("recipe options (--recipe-arg, --dir, --name) need --recipe NAME")
    if config_file is not None:
        check_file(config_file)
    with config_errors_are_usage_errors():
        if recipe is not None:
            fn = get_recipe(recipe)
            cfg = fn(**recipe_kwargs(fn, recipe_args, recipe_values))
            merge_file = config_file
        else:
            cfg = _complete_config(config_file)
            merge_file = None  # already loaded as a whole
        if merge_file is not None or overrides:
            process_config_with_overrides(cfg, merge_file, list(overrides))
    return cfg


def load_source(source: str, overrides: Sequence[str] = ()) -> "ConfigContainer":
    """A config from `source`: a YAML file (an existing path or a .yaml/.yml name) or a recipe name."""
    if os.path.exists(source) or source.endswith(YAML_SUFFIXES):
        return build_config(config_file=source, overrides=overrides)
    return build_config(recipe=source, overrides=overrides)
