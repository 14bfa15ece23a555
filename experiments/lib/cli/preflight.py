"""The command line checked before Hydra starts: `@hydra_preflight`, outside `@hydra.main` on every entry point.

Hydra composes the config, creates the run directory, sets up logging into it and saves the config there
before main(cfg) runs, so `experiments.lib.common.errors.exit_on_user_error` never sees those failures: a bad override
ends in Hydra's multi-line message (exit 1), an unwritable run directory in a traceback. hydra_preflight
repeats Hydra's own composition first (same search path, overrides and run mode) and tries the run
directory, so both end in one line `error: ...` and exit 2 before Hydra writes anything.

    @hydra_preflight
    @hydra.main(version_base="1.3", config_path="../conf", config_name="train_base")
    @exit_on_user_error
    def main(cfg: DictConfig) -> None: ...

It reaches into Hydra 1.3's internals (`hydra.main._run_hydra` and the search-path helpers): hydra-core is
pinned below 1.4 in pyproject.toml.
"""

from __future__ import annotations

import argparse
import errno
import functools
import importlib
import os
import re
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from hydra._internal.hydra import Hydra
from hydra._internal.utils import (
    create_automatic_config_search_path,
    detect_calling_file_or_module_from_task_function,
    detect_task_name,
)
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from experiments.lib.common.errors import EXIT_USER_ERROR, FRESH_RUN_DIRS, one_line, runtime_fault
from experiments.lib.store.pretrained import register_resolver

register_resolver()  # ${pretrained:...} in conf/base/*.yaml: registered before any entry point composes

__all__ = ["hydra_preflight"]

PROBE_PREFIX = ".write-probe"


def hydra_preflight(hydra_main: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate an entry point outside @hydra.main (see the module docstring).

    @hydra.main's function hands the parsed command line, the task and the config path and name to Hydra's
    _run_hydra; the check needs exactly those, so for the duration of the call _run_hydra is replaced by one
    that runs the check, then Hydra's. Called with a config (a test), it is @hydra.main's function unchanged."""
    hydra_module = importlib.import_module("hydra.main")  # `import hydra.main` would give the function
    run_hydra = hydra_module._run_hydra

    def checked_run_hydra(
        args: argparse.Namespace,
        args_parser: argparse.ArgumentParser,
        task_function: Callable[..., Any],
        config_path: str | None,
        config_name: str | None,
        **kwargs: Any,
    ) -> None:
        preflight(args, task_function, config_path, config_name)
        run_hydra(args, args_parser, task_function, config_path, config_name, **kwargs)

    @functools.wraps(hydra_main)
    def main(cfg_passthrough: DictConfig | None = None) -> Any:
        if cfg_passthrough is not None:
            return hydra_main(cfg_passthrough)
        hydra_module._run_hydra = checked_run_hydra
        try:
            return hydra_main()
        finally:
            hydra_module._run_hydra = run_hydra

    return main


def preflight(
    args: argparse.Namespace, task_function: Callable[..., Any], config_path: str | None, config_name: str | None
) -> None:
    """Compose the config as Hydra is about to, and try the run (or sweep) directory; a problem with either is
    printed as `error: <one line>` and exits 2. Help, --info and shell completion write nothing: left to Hydra."""
    if args.help or args.hydra_help or args.info is not None or args.shell_completion:
        return
    calling_file, calling_module = detect_calling_file_or_module_from_task_function(task_function)
    if calling_file is None and calling_module is None:
        return  # Hydra falls back on the caller's stack frame; no entry point of ours gets there
    if args.config_dir is not None and not os.path.isdir(args.config_dir):
        exit_user_error(f"--config-dir {args.config_dir}: not a directory (a directory of configs to search first)")
    config_name = args.config_name if args.config_name is not None else config_name
    config_path = args.config_path if args.config_path is not None else config_path
    search_path = create_automatic_config_search_path(calling_file, calling_module, config_path)
    if args.config_dir is not None:  # as _run_hydra adds it
        search_path.prepend(
            provider="command-line",
            path=f"file://{os.path.abspath(args.config_dir)}",
            anchor=SearchPathQuery(provider="schema"),
        )
    overrides = list(args.overrides)  # Hydra appends hydra.mode to args.overrides: leave them as they are
    hydra = Hydra.create_main_hydra2(
        task_name=detect_task_name(calling_file, calling_module), config_search_path=search_path
    )
    try:
        try:
            mode = run_mode(hydra, args, config_name, overrides)
            cfg = hydra.compose_config(config_name=config_name, overrides=overrides, run_mode=mode)
            if mode == RunMode.MULTIRUN:
                check_sweeps(hydra, cfg, config_name, overrides)
        except (HydraException, OmegaConfBaseException) as e:
            exit_user_error(composition_message(e, overrides, hydra.config_loader))
        if args.cfg is None:  # --cfg only prints the config
            key = "hydra.sweep.dir" if mode == RunMode.MULTIRUN else "hydra.run.dir"
            directory = resolve_run_dir(cfg, key)
            try:
                made = probe_directory(Path(directory))
            except OSError as e:
                exit_user_error(f"{key}={directory}: {run_dir_problem(e, Path(directory))}")
            FRESH_RUN_DIRS[:] = made if mode == RunMode.RUN and made and made[-1] == Path(directory) else []
            if mode == RunMode.RUN and not set("'\\$") & set(directory):
                # The run directory is named by the time: Hydra resolving it again a second later would make
                # another one than the one checked here (and leave this one empty). It takes this one.
                args.overrides.append(f"hydra.run.dir='{directory}'")
    finally:
        GlobalHydra.instance().clear()  # Hydra's own start initializes it again


def exit_user_error(message: str) -> NoReturn:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


def run_mode(hydra: Hydra, args: argparse.Namespace, config_name: str | None, overrides: list[str]) -> RunMode:
    """The mode Hydra's _run_app picks: the config's hydra.mode (a preset sweep sets MULTIRUN), else -m."""
    mode = hydra.get_mode(config_name=config_name, overrides=overrides)
    if mode is None or (args.multirun and mode == RunMode.RUN):
        return RunMode.MULTIRUN if args.multirun else RunMode.RUN
    return mode


def check_sweeps(hydra: Hydra, cfg: DictConfig, config_name: str | None, overrides: list[str]) -> None:
    """A multirun composes each job only when the job starts, so a bad value in a sweep would fail a job (with
    Hydra's multi-line message) after the jobs before it ran. Check every value of a config group's sweep
    against the group's options, and compose once with each sweep at its first value, for its key."""
    params = cfg.hydra.sweeper.get("params") or {}  # a preset sweep's (experiment=sweep_gamma)
    lines = [*overrides, *(f"{key}={value}" for key, value in params.items())]
    first_values = []
    for override in OverridesParser.create().parse_overrides(lines):
        if not override.is_sweep_override() or override.is_hydra_override():
            continue
        try:  # choice and range sweeps; the others (glob, an optimizer's interval) have no list to check
            values = list(override.sweep_string_iterator())
        except HydraException:
            continue
        options = hydra.config_loader.get_group_options(override.key_or_group)
        for value in values:
            if options and value not in (*options, "null"):
                raise MissingConfigException(
                    f"no {override.key_or_group}/{value}", f"{override.key_or_group}/{value}", options
                )
        first_values.append(f"{override.get_key_element()}={values[0]}" if values else override.input_line)
    if first_values:
        hydra.compose_config(config_name=config_name, overrides=[*overrides, *first_values], run_mode=RunMode.MULTIRUN)


def resolve_run_dir(cfg: DictConfig, key: str) -> str:
    """The directory Hydra will create, resolved as its run_job does (${hydra:...} needs HydraConfig set)."""
    HydraConfig.instance().set_config(cfg)
    try:
        return str(OmegaConf.select(cfg, key))
    except OmegaConfBaseException as e:
        exit_user_error(f"{key}: {one_line(e)}")
    finally:
        HydraConfig.instance().cfg = None  # Hydra sets its own when the job starts


def write_probe(path: Path) -> None:
    """Create `path` and write to it, fsync'd: a full disk may only say so when the data reaches it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, b"probe\n")
        os.fsync(fd)
    finally:
        os.close(fd)


def probe_directory(directory: Path) -> list[Path]:
    """Create `directory` and its missing parents and write a file in it, as Hydra will, then remove the file;
    returns the directories it made, outermost first.
    A check that fails also removes every directory made here, so it leaves nothing behind; one that passes
    keeps them for Hydra, which creates the same directory next. Several processes may check one directory
    at once (torchrun's ranks): a directory another one made meanwhile is fine, and none is removed under it."""
    missing = [path for path in (directory, *directory.parents) if not os.path.lexists(path)]
    made: list[Path] = []
    try:
        for path in reversed(missing):
            try:
                os.mkdir(path)
                made.append(path)
            except FileExistsError:
                if not path.is_dir():
                    raise
        probe = directory / f"{PROBE_PREFIX}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            write_probe(probe)
        finally:
            if os.path.lexists(probe):
                probe.unlink()
    except OSError:
        for path in reversed(made):
            try:
                os.rmdir(path)
            except OSError:  # another process wrote into it meanwhile: theirs to keep
                pass
        raise
    return made


def run_dir_problem(error: OSError, directory: Path) -> str:
    """Why the run directory cannot be used, naming the directory rather than the probe file."""
    if error.errno == errno.ENOTDIR or (error.errno == errno.EEXIST and not directory.is_dir()):
        blocker = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), directory)
        return f"cannot create {directory}: {blocker} is a file, not a directory"
    fault = runtime_fault(OSError(error.errno, error.strerror, str(directory)))  # the errno's own subclass
    if fault is not None:
        return fault
    return f"cannot create {directory}: {error.strerror or one_line(error)}"


def typed_override(overrides: list[str], key: str, value: str | None = None) -> str | None:
    """The override as typed that sets `key` (a config key or group), preferring the one that sets `value`."""
    found = []
    for line in overrides:
        try:
            override = OverridesParser.create().parse_override(line)
        except HydraException:
            continue
        if override.key_or_group == key:
            found.append(line)
    exact = [line for line in found if value is not None and value in line.split("=", 1)[-1].split(",")]
    return (exact or found or [None])[0]


def composition_message(error: BaseException, overrides: list[str], loader: Any) -> str:
    """One line for a config Hydra cannot compose: the value as typed, and what is allowed there."""
    if isinstance(error, OverrideParseException):
        return f"cannot parse the override {error.override!r}: {' '.join(error.message.split())}"
    if isinstance(error, MissingConfigException) and error.missing_cfg_file and "/" in error.missing_cfg_file:
        group, name = error.missing_cfg_file.rsplit("/", 1)
        shown = typed_override(overrides, group, name) or f"{group}={name}"
        if error.options:
            return f"{shown}: no option {name!r} in config group {group}; the options are: {', '.join(error.options)}"
        groups = ", ".join(loader.list_groups(""))
        return f"{shown}: there is no config group {group}; the config groups are: {groups}"
    if isinstance(error, MissingConfigException):  # a primary config (--config-name) that is not there
        return str(error).split("\nConfig search path")[0]
    cause = error.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        full_key = str(cause.full_key)
        parent_key, _, key = full_key.rpartition(".")
        shown = typed_override(overrides, full_key) or full_key
        where = parent_key or "the config"
        parent = cause.parent_node
        keys = [str(k) for k in parent.keys()] if isinstance(parent, DictConfig) else []
        if not keys:
            return f"{shown}: {where} has no key {key!r} (it has no keys)"
        return f"{shown}: {where} has no key {key!r}; its keys are: {', '.join(keys)}"
    packages = re.search(r"Could not override '([^']+)'\.\s*Did you mean to override one of (.+?)\?", str(error))
    if packages:
        group, names = packages.groups()
        shown = typed_override(overrides, group) or group
        options = ", ".join(loader.get_group_options(group))
        return (
            f"{shown}: config group {group} is set per package, as one of {names}=<option>; the options are: {options}"
        )
    text = one_line(error)
    if isinstance(cause, OmegaConfBaseException):
        text += f": {one_line(cause)}"
    return text
