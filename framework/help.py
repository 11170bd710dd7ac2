"""What ``python run.py --help`` lists: every config group and every key of conf/config.yaml, each
with the line that documents it, and the value this run would use.

The descriptions are conf/config.yaml's own inline comments, read from the file on each call, so
the help says what the config says and cannot drift from it: a group's is the comment on its line
of the defaults list (``- data: digits  # where the samples come from``), a key's the comment
beside its value (``task: train  # train | eval ...``). The groups' options are the files of
conf/<group>/; the chosen options and the values come from the composed config, so ``--help``
after overrides (``experiment=digits_cnn --help``) shows what that command would run.

Hydra's help template (conf/hydra/default.yaml, ``help.template``) calls ``text`` through the
``${runlab.help:}`` resolver. Keys the config does not list in conf/config.yaml (``search.*``,
which the sweeper fills in for each trial) are not shown; ``--cfg job`` prints every key.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

# `key: value  # comment`, or `- group: option  # comment` in the defaults list.
LINE = re.compile(r"^(?P<indent> *)(?P<entry>- +)?(?P<key>[A-Za-z_]\w*) *:(?P<rest>.*)$")
COMMENT = re.compile(r"(?:^|\s)#\s?(?P<text>.*)$")
NOT_GROUPS = ("hydra",)  # Hydra's own settings: --hydra-help lists them
WIDTH = 32  # the widest key=value whose description starts on the same line


def read_comments(config_file: Path) -> Tuple[Dict[str, str], Dict[str, str]]:
    """conf/config.yaml's inline comments: {group: comment} from its defaults list, and
    {dotted.key: comment} for its own keys, in the file's order. A key without a comment maps to ""."""
    groups: Dict[str, str] = {}
    keys: Dict[str, str] = {}
    parents: List[Tuple[int, str]] = []  # (indent, key) of the blocks the line is inside
    for line in config_file.read_text().splitlines():
        match = LINE.match(line)
        if match is None:
            continue
        indent, rest = len(match["indent"]), match["rest"]
        comment = COMMENT.search(rest)
        description = comment["text"].strip() if comment else ""
        value = rest[:comment.start()].strip() if comment else rest.strip()
        while parents and parents[-1][0] >= indent:
            parents.pop()
        path = [key for _, key in parents]
        if match["entry"]:
            if path == ["defaults"]:
                groups[match["key"]] = description
            continue
        if path and path[0] == "defaults":
            continue
        keys[".".join([*path, match["key"]])] = description
        if not value:  # a block: its keys follow, indented
            parents.append((indent, match["key"]))
    del keys["defaults"]  # the groups', above
    return groups, keys


def shown(value: Any) -> str:
    """A value as it is typed on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return '""'
    return str(value)


def raw_value(config: Dict[str, Any], dotted: str) -> Optional[str]:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return None if isinstance(node, dict) else shown(node)


def rows(entries: List[Tuple[str, str, str]]) -> List[str]:
    """(left, description, below) as aligned lines: the description beside ``left`` (under it when
    ``left`` is wider than WIDTH), then ``below`` under the description, if any."""
    width = min(WIDTH, max(len(left) for left, _, _ in entries)) + 2
    lines = []
    for left, description, below in entries:
        if not description:
            lines.append(f"  {left}")
        elif len(left) + 2 > width:
            lines += [f"  {left}", f"  {'':{width}}{description}"]
        else:
            lines.append(f"  {left:{width}}{description}")
        if below:
            lines.append(f"  {'':{width}}{below}")
    return lines


def text(root: DictConfig) -> str:
    """The groups and keys section of --help, for the composed config ``root`` (Hydra's, with its
    ``hydra`` node). ``$`` is doubled: Hydra fills the template in with ``string.Template``."""
    from framework.config import CONF_DIR as conf_dir  # not at import: framework.config imports the resolvers
    group_comments, key_comments = read_comments(conf_dir / "config.yaml")
    choices = OmegaConf.select(root, "hydra.runtime.choices", default=None) or {}
    on_disk = sorted(path.name for path in conf_dir.iterdir() if path.is_dir() and path.name not in NOT_GROUPS)
    groups = [group for group in group_comments if group in on_disk] + [g for g in on_disk if g not in group_comments]

    listed = []
    for group in groups:
        options = sorted(path.stem for path in (conf_dir / group).glob("*.yaml"))
        marked = ", ".join(f"{option}*" if option == choices.get(group) else option for option in options)
        listed.append((f"{group}:", group_comments.get(group, ""), marked))
    lines = ["== Config groups: GROUP=OPTION picks an option (* marks this run's) ==", "", *rows(listed)]

    top_keys = sorted({key.split(".")[0] for key in key_comments} & set(root.keys()))
    values = OmegaConf.to_container(OmegaConf.masked_copy(root, top_keys), resolve=False, enum_to_str=True)
    keys = []
    for key, description in key_comments.items():
        value = raw_value(values, key)
        keys.append((key if value is None else f"{key}={value}", description, ""))
    lines += ["", "== Keys: KEY=VALUE sets one (shown with this run's value) ==", "", *rows(keys)]
    return "\n".join(lines).replace("$", "$$")
