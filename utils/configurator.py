"""Command-line and config-file overrides for a dataclass of defaults, nanoGPT style.

Owns: turning `python train_my_ddp.py config/foo.py --lr=3e-4 --compile=false` into a
type-checked configuration. A positional argument is a config file, read by its extension:
`.py` files are plain Python written by the user and are *executed* once, at start-up, as the
nanoGPT configurator does (so they can run any code: use only files you trust); `.json`,
`.yaml` and `.yml` files are read as data (YAML needs PyYAML). Any other file is refused, never
executed. Only names that are fields of the defaults are taken from a file. A value given on
the command line always wins over a file.

Must never: exec anything read back from a run directory (the resolved configuration is
written as JSON by `save_config_json` and only ever read as JSON), or accept a key that is
not a field, or silently coerce a value of the wrong type.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import os
import textwrap
import types
import typing
from typing import Any, Optional, Sequence, TypeVar

from utils.disk_space import writing
from utils.publish import atomic_write_json

T = TypeVar("T")


def flag(default: Any, help: str) -> Any:
    """A dataclass field that is a `--key=value` flag: its default and the help line `help_text` prints."""
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: default, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


class ConfigError(ValueError):
    """A configuration problem a user must fix: unknown key, wrong type, unreadable file."""
    exit_code = 2  # EXIT_BAD_CONFIG (utils/constants.py), read by utils.errors.exit_code_for


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """Optional[X] / X | None -> (X, True)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


_WAS_BOOL = {"fused_kernels"}  # str fields that used to be bool: True/False still read as "true"/"false"


def coerce_value(key: str, raw: Any, tp: Any, source: str) -> Any:
    """Convert `raw` (a string from argv, or a Python value from a config file) to `tp`.

    Raises ConfigError naming the key, the expected type, the offending value and its source.
    """
    base, optional = _unwrap_optional(tp)
    if optional and (raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null"))):
        return None

    def fail() -> ConfigError:
        return ConfigError(f"{source}: {key}={raw!r} is not a valid {_type_name(tp)}")

    origin = typing.get_origin(base) or base
    if isinstance(raw, str) and origin is not str:
        text = raw.strip()
        if origin is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise fail()
        if origin is int:
            try:
                return int(text)
            except ValueError:
                raise fail() from None
        if origin is float:
            try:
                return float(text)
            except ValueError:
                raise fail() from None
        if origin in (dict, list, tuple):
            try:
                raw = json.loads(text)
            except json.JSONDecodeError:
                try:
                    raw = ast.literal_eval(text)
                except (ValueError, SyntaxError):
                    raise fail() from None
    # Python values (from a config file, or parsed containers above)
    if origin is bool:
        if isinstance(raw, bool):
            return raw
        raise fail()
    if origin is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        raise fail()
    if origin is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        raise fail()
    if origin is str:
        if isinstance(raw, str):
            return raw
        if isinstance(raw, bool) and key in _WAS_BOOL:  # saved runs and config files of the bool days
            return "true" if raw else "false"
        raise fail()
    if origin in (dict,):
        if isinstance(raw, dict):
            return raw
        raise fail()
    if origin in (list, tuple):
        if isinstance(raw, (list, tuple)):
            return origin(raw)
        raise fail()
    if base is Any:
        return raw
    raise ConfigError(f"{source}: {key} has an unsupported field type {_type_name(tp)}")


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown_key_error(key: str, known: Sequence[str], source: str) -> ConfigError:
    from utils.cli import TRAIN_HINTS
    if key in TRAIN_HINTS:  # a name from the HF Trainer / torchtitan with no one-to-one flag here
        return ConfigError(f"{source}: unknown config key {key!r}: {TRAIN_HINTS[key]}")
    close = difflib.get_close_matches(key, list(known), n=3)
    hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
    return ConfigError(f"{source}: unknown config key {key!r}{hint}")


def _aliases_for(fields: dict[str, Any]) -> dict[str, str]:
    """HF Trainer / torchtitan / nanoGPT spellings (utils.cli.TRAIN_ALIASES) of fields that exist here."""
    from utils.cli import TRAIN_ALIASES
    return {a: t for a, t in TRAIN_ALIASES.items() if t in fields and a not in fields}


PY_CONFIG_EXT = (".py",)
DATA_CONFIG_EXT = (".json", ".yaml", ".yml")
CONFIG_FILES_HELP = ("config files (positional, applied in order, --key=value wins): a .py file is executed "
                     "as Python code (it can do anything: use only files you trust); .json, .yaml and .yml "
                     "files are read as data (YAML needs PyYAML); any other file is refused")


def _is_config_file_name(arg: str) -> bool:
    return arg.lower().endswith(PY_CONFIG_EXT + DATA_CONFIG_EXT)


# A .py config runs once per process: the pre-check, the start and a resume's re-parse all read the same values
# (a config that prints, counts or opens files does so once). Keyed by the file and its exact text: an edited file
# runs again.
_PY_VALUES: dict[tuple[str, str], dict[str, Any]] = {}


def _values_from_py(path: str, code: str) -> dict[str, Any]:
    key = (os.path.abspath(path), code)
    if key not in _PY_VALUES:
        _PY_VALUES[key] = _exec_py_config(path, code)
    return dict(_PY_VALUES[key])


def _exec_py_config(path: str, code: str) -> dict[str, Any]:
    scope: dict[str, Any] = {}
    try:
        exec(compile(code, path, "exec"), scope)  # user-written config, the nanoGPT way
    except Exception as e:  # report any error inside the user's file with its name
        raise ConfigError(f"config file {path}: {type(e).__name__}: {e}") from e
    return {k: v for k, v in scope.items()
            if not (k.startswith("_") or isinstance(v, (types.ModuleType, types.FunctionType, type)))}


def _json_object_without_duplicates(path: str):
    """object_pairs_hook for json.loads: a key given twice in one object is an error, not "last one wins"."""
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise ConfigError(f"config file {path}: key {k!r} is given twice (which value was meant?)")
            out[k] = v
        return out
    return hook


def _yaml_loader_without_duplicates(yaml: Any, path: str) -> Any:
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""
    class Loader(yaml.SafeLoader):
        pass

    def construct_mapping(loader: Any, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: let PyYAML report it
                continue
            if first is not None:
                raise ConfigError(f"config file {path}: key {key!r} is given twice (lines {first} and {line}; "
                                  "which value was meant?)")
            seen[key] = line
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return Loader


def _values_from_data(path: str, text: str) -> dict[str, Any]:
    if path.lower().endswith(".json"):
        try:
            data = json.loads(text, object_pairs_hook=_json_object_without_duplicates(path))
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path}: not valid JSON ({e})") from None
    else:
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"config file {path}: YAML config files need PyYAML (pip install pyyaml), "
                              "or write the config as .json") from None
        try:
            data = yaml.load(text, Loader=_yaml_loader_without_duplicates(yaml, path))  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: not valid YAML ({' '.join(str(e).split())})") from None
        if data is None:  # an empty YAML file
            data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: must hold a mapping of config keys to values, "
                          f"not a {type(data).__name__}")
    return data


def _values_from_file(path: str, fields: dict[str, Any]) -> dict[str, Any]:
    if not _is_config_file_name(path):
        raise ConfigError(f"config file {path}: not a config file; expected a .py (executed as Python), "
                          ".json, .yaml or .yml file")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path}: unreadable ({e})") from None
    raw = _values_from_py(path, text) if path.lower().endswith(PY_CONFIG_EXT) else _values_from_data(path, text)
    values = {}
    for k, v in raw.items():
        if k not in fields:
            raise _unknown_key_error(str(k), fields, f"config file {path}")
        values[k] = v
    return values


def parse_config(defaults: T, argv: Sequence[str], given: Optional[set[str]] = None) -> T:
    """Return a copy of the dataclass `defaults` with config files and `--key=value` applied.

    argv items: a config file `path/to/config.{py,json,yaml,yml}` (applied in order; `.py` is
    executed, the others are read as data), `--key=value`, or `--flag` (bool True).
    given: when a set, the field names argv set (on the command line, aliases resolved, or in a config
    file) are added to it: what was asked for explicitly, not left at its default.
    """
    fields = _field_types(type(defaults))
    aliases = _aliases_for(fields)
    file_values: dict[str, Any] = {}
    cli_values: dict[str, Any] = {}
    for arg in argv:
        if not arg.startswith("--"):
            if _is_config_file_name(arg) or os.path.isfile(arg):
                for k, v in _values_from_file(arg, fields).items():
                    file_values[k] = coerce_value(k, v, fields[k], f"config file {arg}")
                continue
            raise ConfigError(f"unexpected argument {arg!r}: use --key=value or a config file "
                              "(.py, .json, .yaml, .yml)")
        body = arg[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
        else:
            key, raw = body, "true"
        key = key.replace("-", "_")
        key = aliases.get(key, key)
        if key not in fields:
            raise _unknown_key_error(key, fields, "command line")
        cli_values[key] = coerce_value(key, raw, fields[key], "command line")
    if given is not None:
        given.update(file_values, cli_values)
    return dataclasses.replace(defaults, **{**file_values, **cli_values})


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config_json(cfg: Any, path: str) -> None:
    """Write the resolved configuration as JSON (atomically). It is for reading, never exec. A write that does
    not fit raises DiskFullError naming the file (exit 7; utils/disk_space.py)."""
    with writing(path):
        atomic_write_json(path, config_to_dict(cfg), indent=2, ensure_ascii=False, sort_keys=True)


def help_text(defaults: Any, title: str, prog: str | None = None) -> str:
    """One line per key with its type, default and the help from field metadata.
    prog: the command's name in the usage line (default: the running script's file name)."""
    import sys
    fields = _field_types(type(defaults))
    prog = prog or os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "") or "python"
    lines = [title, "", f"usage: {prog} [config.py|config.json|config.yaml ...] [--key=value ...]", "",
             textwrap.fill(CONFIG_FILES_HELP, width=100), ""]
    for f in dataclasses.fields(defaults):
        doc = f.metadata.get("help", "")
        lines.append(f"  --{f.name}={getattr(defaults, f.name)!r}  ({_type_name(fields[f.name])}) {doc}")
    aliases = _aliases_for(fields)
    if aliases:
        lines += ["", "aliases (Hugging Face Trainer / torchtitan / nanoGPT names): " +
                  ", ".join(f"--{a} = --{t}" for a, t in sorted(aliases.items())),
                  "booleans: --name=true|false (yes/no, on/off, 1/0); a bare --name means true"]
    return "\n".join(lines)
