"""Layered settings: defaults < config file < ``PDGATE_*`` environment < flags.

Every leaf field of :class:`pdgate.config.GatewayConfig` (nested sub-models
included) is settable in three ways, all derived from the model itself by
:func:`leaves`, so a new config field needs no other code:

- config file (YAML or JSON): the model's own shape, ``timeouts: {prefill_s: 3}``;
- environment: ``PDGATE_`` + the field path in upper case joined by ``__``,
  e.g. ``PDGATE_PORT=9000``, ``PDGATE_TIMEOUTS__PREFILL_S=3``. Lists take a
  JSON array or comma/space separated items (``PDGATE_DECODE="http://d0:8000,http://d1:8000"``);
  mappings and lists of objects take JSON; ``none``/``null`` clears an
  optional field. ``PDGATE_CONFIG`` names the config file. Unknown
  ``PDGATE_*`` names are ignored (other tools share the prefix);
- flags: ``--`` + the path joined by ``.`` with ``-`` for ``_``, e.g.
  ``--port``, ``--prefill-policy``, ``--timeouts.prefill-s``; list flags take
  several values and may repeat (``--prefill URL URL`` or ``--prefill URL
  --prefill URL``, as vllm-router). vllm-router's names for the same things
  are accepted too (:data:`ROUTER_ALIASES`).

Help text comes from the ``Attributes:`` sections of the config classes'
docstrings (:func:`field_docs`), which also feed ``docs/configuration.md``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from pdgate.config import GatewayConfig, read_config_file

ENV_PREFIX = "PDGATE_"
#: Environment variable naming the config file (a ``--config`` flag wins).
CONFIG_ENV = "PDGATE_CONFIG"
_FLAG_DEST = "cfg:"
#: policy fields -> policy registry kind (their choices are listed in --help)
_POLICY_KINDS = {"policy": "instance", "prefill_policy": "instance", "decode_policy": "instance",
                 "route_policy": "route", "admission_policy": "admission"}

#: vllm-router flag names that mean the same as a pdgate field path (extra
#: option strings of that field's flag).
ROUTER_ALIASES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("discovery", "namespace"): ("--service-discovery-namespace",),
    ("discovery", "port"): ("--service-discovery-port",),
    ("discovery", "prefill_selector"): ("--prefill-selector",),
    ("discovery", "decode_selector"): ("--decode-selector",),
    ("discovery", "selector"): ("--selector",),
}


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``(T, True)`` for ``T | None``, else ``(tp, False)``."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) < len(get_args(tp)):
            return (args[0] if len(args) == 1 else Union[tuple(args)]), True
    return tp, False


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


@dataclass(frozen=True)
class Leaf:
    """One settable config field.

    Attributes:
        path: keys from the top of the config, e.g. ``("timeouts", "prefill_s")``.
        annotation: the field's type (``Optional`` unwrapped).
        optional: whether ``None`` is allowed.
        field: pydantic's field info (default, constraints).
        doc: help text from the owning class's docstring ('' if none).
    """

    path: tuple[str, ...]
    annotation: Any
    optional: bool
    field: FieldInfo
    doc: str

    @property
    def key(self) -> str:
        """Dotted path as in the docs, ``timeouts.prefill_s``."""
        return ".".join(self.path)

    @property
    def env(self) -> str:
        """Environment variable, ``PDGATE_TIMEOUTS__PREFILL_S``."""
        return ENV_PREFIX + "__".join(p.upper() for p in self.path)

    @property
    def flag(self) -> str:
        """Command-line flag, ``--timeouts.prefill-s``."""
        return "--" + ".".join(p.replace("_", "-") for p in self.path)

    @property
    def kind(self) -> Literal["bool", "list", "json", "scalar"]:
        """How a string value is parsed: bool, list of scalars, JSON, or left to pydantic."""
        tp = self.annotation
        if tp is bool:
            return "bool"
        origin = get_origin(tp)
        if origin is list:
            (item,) = get_args(tp) or (str,)
            item, _ = _unwrap_optional(item)
            return "json" if _is_model(item) or get_origin(item) in (list, dict) else "list"
        if origin is dict or _is_model(tp):
            return "json"
        return "scalar"

    def type_name(self) -> str:
        """Human-readable type for docs and help."""
        tp = self.annotation
        if get_origin(tp) is Literal:
            s = " | ".join(repr(a) for a in get_args(tp))
        else:
            s = re.sub(r"\b(typing|pdgate\.config)\.", "", getattr(tp, "__name__", None) or str(tp))
            if get_origin(tp) is not None:
                s = re.sub(r"\b(typing|pdgate\.config)\.", "", str(tp))
        return s + (" | None" if self.optional else "")

    def default_repr(self) -> Any:
        """The default value, JSON-able."""
        f = self.field
        v = f.default_factory() if f.default_factory is not None else f.default  # type: ignore[call-arg]
        return to_jsonable_python(v)

    def parse(self, raw: str, source: str) -> Any:
        """Turn a string (environment) into a value pydantic validates.

        Raises:
            ValueError: malformed JSON, naming ``source``.
        """
        if self.optional and raw.strip().lower() in ("none", "null"):
            return None
        kind = self.kind
        try:
            if kind == "json" or (kind == "list" and raw.lstrip().startswith("[")):
                return json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}: not valid JSON: {e}") from None
        if kind == "list":
            return [x for x in re.split(r"[,\s]+", raw.strip()) if x]
        return raw


def field_docs(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> text from the ``Attributes:`` section of ``model``'s docstring.

    ``a / b: text`` documents both ``a`` and ``b``; continuation lines are
    joined. A class without such a section documents nothing.
    """
    doc = inspect.cleandoc(model.__doc__ or "")
    out: dict[str, str] = {}
    m = re.search(r"^Attributes:\n((?:[ \t]+.*\n?|\n)*)", doc, re.M)
    if not m:
        return out
    names: list[str] = []
    for line in m.group(1).splitlines():
        head = re.match(r"^ {4}([A-Za-z_][\w /]*?):\s*(.*)$", line)
        if head and not line.startswith("     "):
            names = [n.strip() for n in head.group(1).split("/")]
            for n in names:
                out[n] = head.group(2).strip()
        elif line.strip() and names:
            for n in names:
                out[n] = (out[n] + " " + line.strip()).strip()
    return out


def leaves(model: type[BaseModel] = GatewayConfig, prefix: tuple[str, ...] = ()) -> list[Leaf]:
    """Every settable field of ``model``, depth first, sub-models expanded."""
    docs = field_docs(model)
    out: list[Leaf] = []
    for name, f in model.model_fields.items():
        key = f.alias or name
        tp, optional = _unwrap_optional(f.annotation)
        if _is_model(tp) and not optional:
            out += leaves(tp, prefix + (key,))
            continue
        doc = docs.get(key) or docs.get(name) or ""
        out.append(Leaf(prefix + (key,), tp, optional, f, doc))
    return out


def _set_path(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        nxt = data.get(p)
        if not isinstance(nxt, dict):
            nxt = data[p] = {}
        data = nxt
    data[path[-1]] = value


def deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base`` (a new dict); nested mappings merge key by key."""
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def env_layer(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The config mapping set by ``PDGATE_*`` variables of ``environ`` (default ``os.environ``).

    Raises:
        ValueError: a variable holds malformed JSON.
    """
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    for leaf in leaves():
        raw = environ.get(leaf.env)
        if raw is not None:
            _set_path(data, leaf.path, leaf.parse(raw, leaf.env))
    return data


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag per config leaf (plus vllm-router aliases) to ``parser``.

    Unset flags leave no trace in the parsed namespace, so they never
    override the file or the environment; :func:`flag_layer` collects them.
    """
    parser.add_argument("--config", metavar="FILE",
                        help=f"YAML or JSON config file (env {CONFIG_ENV}); env and flags override it")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for leaf in leaves():
        if len(leaf.path) == 1:
            group: Any = parser
        else:
            group = groups.get(leaf.path[0])
            if group is None:
                group = groups[leaf.path[0]] = parser.add_argument_group(f"{leaf.path[0]} settings")
        names = [leaf.flag, *ROUTER_ALIASES.get(leaf.path, ())]
        kw: dict[str, Any] = {"dest": _FLAG_DEST + leaf.key, "default": argparse.SUPPRESS}
        default = leaf.default_repr()
        help_ = f"{_md(leaf.doc)} " if leaf.doc else ""
        if leaf.key in _POLICY_KINDS:
            from pdgate.policies import available_policies

            help_ += f"One of {', '.join(sorted(available_policies(_POLICY_KINDS[leaf.key])))}. "
        help_ += f"[env {leaf.env}; default {json.dumps(default)}]"
        kw["help"] = help_.replace("%", "%%")
        if leaf.kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif leaf.kind == "list":
            kw.update(nargs="+", action="extend", metavar=leaf.path[-1].upper())
        elif leaf.kind == "json":
            kw.update(type=_json_arg, metavar="JSON")
        else:
            choices = get_args(leaf.annotation) if get_origin(leaf.annotation) is Literal else None
            if choices:
                kw["choices"] = list(choices)
            kw["metavar"] = leaf.path[-1].upper() if not choices else None
        group.add_argument(*names, **kw)
    # vllm-router's --service-discovery switch (Kubernetes pods).
    parser.add_argument("--service-discovery", dest=_FLAG_DEST + "discovery.type", action="store_const",
                        const="kubernetes", default=argparse.SUPPRESS,
                        help="discover instances from Kubernetes pods (= --discovery.type kubernetes)")


def _json_arg(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None


def flag_layer(args: argparse.Namespace) -> dict[str, Any]:
    """The config mapping set by the flags present in ``args``."""
    data: dict[str, Any] = {}
    for name, value in vars(args).items():
        if name.startswith(_FLAG_DEST):
            if name in (_FLAG_DEST + "prefill", _FLAG_DEST + "decode"):
                # vllm-router style "--prefill URL 9000": drop bootstrap ports
                value = [v for v in value if not re.fullmatch(r"\d+|none", str(v))]
            _set_path(data, tuple(name[len(_FLAG_DEST):].split(".")), value)
    return data


def resolve_config(config_file: str | Path | None = None, *, environ: Mapping[str, str] | None = None,
                   flags: Mapping[str, Any] | None = None) -> GatewayConfig:
    """Merge defaults < file < environment < flags and validate.

    Args:
        config_file: YAML/JSON file; ``None`` uses ``$PDGATE_CONFIG`` if set.
        environ: environment (default ``os.environ``).
        flags: mapping from :func:`flag_layer`.

    Raises:
        pydantic.ValidationError: the merged config is invalid.
        ValueError: malformed file or environment value.
        OSError: the file cannot be read.
    """
    environ = os.environ if environ is None else environ
    config_file = config_file or environ.get(CONFIG_ENV) or None
    data: dict[str, Any] = read_config_file(config_file) if config_file else {}
    data = deep_merge(data, env_layer(environ))
    data = deep_merge(data, flags or {})
    return GatewayConfig.model_validate(data)


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """:func:`resolve_config` for a namespace parsed with :func:`add_config_flags`."""
    return resolve_config(getattr(args, "config", None), environ=environ, flags=flag_layer(args))


def dump_config(config: GatewayConfig, fmt: Literal["yaml", "json"] = "yaml") -> str:
    """The effective config as YAML or JSON text (loadable again with ``--config``)."""
    data = config.model_dump(mode="json", by_alias=True)
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    import yaml  # type: ignore[import-untyped]

    return str(yaml.safe_dump(data, sort_keys=False))


def apply_file_env_defaults(parser: argparse.ArgumentParser, config_file: str | Path | None,
                            environ: Mapping[str, str], env_prefix: str) -> None:
    """Layer a plain argparse parser's defaults: defaults < file < environment (flags win later).

    For commands without a config model (``pdgate sim-fleet``): the file maps
    flag names (``time_scale`` or ``time-scale``) to values; the environment
    variable of a flag is ``env_prefix`` + its dest in upper case
    (``PDGATE_SIM_FLEET_TIME_SCALE``). String values are converted by the
    flag's own ``type``; switches take ``1/true/yes/on``; repeated flags take
    comma-separated lists.

    Raises:
        ValueError: the file names an unknown flag.
    """
    data = {k.replace("-", "_"): v for k, v in (read_config_file(config_file) if config_file else {}).items()}
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    unknown = set(data) - set(actions)
    if unknown:
        raise ValueError(f"{config_file}: unknown keys {sorted(unknown)}; known: {sorted(actions)}")
    defaults: dict[str, Any] = dict(data)
    for dest, action in actions.items():
        raw = environ.get(env_prefix + dest.upper())
        if raw is None:
            continue
        if action.nargs == 0:  # store_true / store_false
            defaults[dest] = raw.strip().lower() in ("1", "true", "yes", "on")
            if isinstance(action, argparse._StoreFalseAction):
                defaults[dest] = not defaults[dest]
        elif isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*"):
            defaults[dest] = [x for x in re.split(r"[,\s]+", raw.strip()) if x]
        else:
            defaults[dest] = raw
    for dest, v in list(defaults.items()):
        action = actions[dest]
        if isinstance(v, str) and action.type is not None and callable(action.type):
            defaults[dest] = action.type(v)  # type: ignore[operator]
        if action.choices is not None and defaults[dest] not in action.choices:
            raise ValueError(f"{dest}: {defaults[dest]!r} not one of {list(action.choices)}")
    parser.set_defaults(**defaults)


def config_reference() -> str:
    """Markdown reference of every config field (``docs/configuration.md``),
    generated from :class:`GatewayConfig`: key, type, default, environment
    variable, flag, description. ``scripts/gen_config_docs.py`` writes it."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/gen_config_docs.py from pdgate.config.GatewayConfig; do not edit. -->",
        "",
        "Every field can be set in the config file (`pdgate serve --config FILE`, YAML or JSON, "
        "nested as shown by the dotted key), as a `PDGATE_*` environment variable, or as a flag; "
        "precedence: defaults < file < environment < flags. `PDGATE_CONFIG` names the file. "
        "Lists take JSON or comma-separated values in the environment and several values after "
        "the flag; mappings take JSON. `pdgate check-config [flags]` prints the effective config.",
        "",
        "vllm-router flag names accepted as well: "
        + ", ".join(f"`{a}` (= `{'.'.join(p)}`)" for p, names in ROUTER_ALIASES.items() for a in names)
        + ", `--service-discovery` (= `discovery.type: kubernetes`), `--policy` (both legs' "
        "instance policy unless `prefill_policy` / `decode_policy` are set).",
    ]
    section = None
    for leaf in leaves():
        sec = leaf.path[0] if len(leaf.path) > 1 else ""
        if sec != section:
            section = sec
            title = f"`{sec}`" if sec else "Top level"
            out += ["", f"## {title}", ""]
            if sec:
                sub = GatewayConfig.model_fields[sec].annotation
                first = inspect.cleandoc(getattr(sub, "__doc__", "") or "").split("\n\n")[0]
                if first:
                    out += [_md(" ".join(first.split())), ""]
            out += ["| key | type | default | environment | flag | description |",
                    "|---|---|---|---|---|---|"]
        default = json.dumps(leaf.default_repr())
        doc = _md(leaf.doc).replace("|", "\\|")
        typ = leaf.type_name().replace("|", "\\|")
        out.append(f"| `{leaf.key}` | {typ} | `{default}` | `{leaf.env}` | `{leaf.flag}` | {doc} |")
    return "\n".join(out) + "\n"


def _md(rst: str) -> str:
    """reStructuredText inline markup of the docstrings as Markdown."""
    return re.sub(r":\w+:`([^`]+)`", r"`\1`", rst.replace("``", "`"))
