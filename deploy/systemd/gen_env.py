"""Write deploy/systemd/kvctl.env from the settings model: every setting, commented, with its default.

    python deploy/systemd/gen_env.py            # rewrite kvctl.env
    python deploy/systemd/gen_env.py --check    # exit 1 if kvctl.env is not what the model gives
    python deploy/systemd/gen_env.py --stdout   # print it

Run it after adding or changing a setting in controller/settings.py; tests/unit/test_deploy.py
fails while a setting is missing from the file or shows a stale default.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import typing
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from a source tree
    sys.path.insert(0, str(ROOT))

from controller.settings import Settings  # noqa: E402

OUT = Path(__file__).with_name("kvctl.env")
WIDTH = 100
LIST_EXAMPLE = "'" + json.dumps(["/usr/local/bin/llama-server", "-m", "m.gguf"]) + "'"
URL_LIST_EXAMPLE = "'" + json.dumps(["http://10.0.0.7:8080", "http://10.0.0.8:8080"]) + "'"

HEADER = """\
# kvctl settings for kvctl.service (EnvironmentFile=/etc/kvctl/kvctl.env).
#
# Generated from controller/settings.py by deploy/systemd/gen_env.py: do not edit the comments
# here, edit the model and regenerate. Every setting is listed, commented out, with its default;
# uncomment a line to change it.
#
# Precedence: command-line flags > these variables > the TOML file of --config > defaults.
# Names: {prefix}<GROUP>{delim}<SETTING>. Lists are JSON in single quotes (systemd keeps single-
# quoted text as it is). An invalid value stops kvctl with one line naming the setting.
# This file may hold tokens: install it 0640 root:kvctl.
#
# With deploy/systemd/llama-server.service the defaults fit as they are: the server on
# 127.0.0.1:8081, the proxy on 127.0.0.1:8080, the admin listener on 127.0.0.1:8091. To take
# clients from other hosts set {prefix}PROXY{delim}LISTEN=0.0.0.0:8080; an admin listener off
# loopback needs {prefix}ADMIN{delim}TOKEN. Leave {prefix}SUPERVISOR{delim}SPAWN unset: the server
# has its own unit, and kvctl attaches to it.
"""


def env_default(value: Any) -> str | None:
    """The default as an environment value; None when unset."""
    if value is None:
        return None
    if isinstance(value, SecretStr):
        return None
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple, dict)):
        return "'" + json.dumps(value) + "'"
    return str(value)


def field_default(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return field.default


def settings_fields(
    model: type[BaseModel] = Settings, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], FieldInfo, type[BaseModel] | None]]:
    """(dotted path, field, the group model when the field is a group) for every field, depth first."""
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield (*path, name), field, ann
            yield from settings_fields(ann, (*path, name))
        else:
            yield (*path, name), field, None


def is_list(annotation: Any) -> bool:
    if typing.get_origin(annotation) in (list, tuple):
        return True
    return any(is_list(a) for a in typing.get_args(annotation))


def env_name(path: tuple[str, ...]) -> str:
    prefix = str(Settings.model_config.get("env_prefix", ""))
    delim = str(Settings.model_config.get("env_nested_delimiter", "__"))
    return prefix + delim.join(path).upper()


def comment(text: str, indent: str = "# ") -> list[str]:
    paragraphs = [" ".join(p.split()) for p in text.strip().split("\n\n")]
    lines: list[str] = []
    for i, p in enumerate(paragraphs):
        if i:
            lines.append("#")
        lines.extend(textwrap.wrap(p, WIDTH - len(indent), initial_indent=indent, subsequent_indent=indent))
    return lines


def render() -> str:
    prefix = str(Settings.model_config.get("env_prefix", ""))
    delim = str(Settings.model_config.get("env_nested_delimiter", "__"))
    out = [HEADER.format(prefix=prefix, delim=delim).rstrip("\n")]
    for path, field, group in settings_fields():
        if group is not None:
            title = f"--- {'.'.join(path)} "
            out += ["", "", "# " + title + "-" * max(3, WIDTH - 2 - len(title))]
            if group.__doc__:
                out += comment(group.__doc__)
            continue
        default = env_default(field_default(field))
        out.append("")
        out += comment(field.description or "(no description)")
        if is_list(field.annotation):
            example = URL_LIST_EXAMPLE if path[-1] == "drain_peers" else LIST_EXAMPLE
            out.append("# format: a JSON list in single quotes, e.g. " + example)
        out.append(f"# default: {'unset' if default is None else default}")
        out.append(f"#{env_name(path)}={'' if default is None else default}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if kvctl.env differs from the model")
    mode.add_argument("--stdout", action="store_true", help="print instead of writing kvctl.env")
    args = parser.parse_args(argv)
    text = render()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python deploy/systemd/gen_env.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
