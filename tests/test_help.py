"""`python run.py --help` as a user types it: every group and key of conf/ with the line that
documents it in conf/config.yaml, the task values, and none of the keys the sweeper fills in."""
import re
from pathlib import Path
from typing import Any, Dict, List

import yaml

from framework.config import Task

CONF = Path(__file__).resolve().parent.parent / "conf"
ROOT = yaml.safe_load((CONF / "config.yaml").read_text())
GROUPS = sorted(path.name for path in CONF.iterdir() if path.is_dir() and path.name != "hydra")


def keys_of(node: Dict[str, Any], prefix: str = "") -> List[str]:
    """conf/config.yaml's own keys, its blocks' keys dotted; a block ends with "." (it has no value)."""
    keys = []
    for key, value in node.items():
        if key == "defaults":
            continue
        keys.append(f"{prefix}{key}" if isinstance(value, dict) else f"{prefix}{key}=")
        if isinstance(value, dict):
            keys += keys_of(value, f"{prefix}{key}.")
    return keys


def entry(help_text: str, left: str) -> List[str]:
    """The entry --help lists for ``left`` (a `group:`, a block, or `key=` of `key=value`): its first
    word, then the rest of its line and the lines indented under it, each stripped; "" for none."""
    lines = help_text.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"  \S", line)
              and (line.split()[0] == left or left.endswith("=") and line.split()[0].startswith(left))]
    assert starts, f"--help does not list {left!r}:\n{help_text}"
    i = starts[0]
    parts = [part.strip() for part in lines[i].strip().split(None, 1)]
    while i + 1 < len(lines) and lines[i + 1].startswith("   "):
        i += 1
        parts.append(lines[i].strip())
    return parts + [""] * (3 - len(parts))


def test_help_describes_every_group_and_key_and_lists_the_tasks(cli):
    result = cli("--help")
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert len(GROUPS) >= 15
    for group in GROUPS:
        _, description, options, *more = entry(out, f"{group}:")
        assert description and not more, group
        assert set(re.findall(r"\w+", options)) == {path.stem for path in (CONF / group).glob("*.yaml")}, group
    for key in keys_of(ROOT):
        assert entry(out, key)[1], key
    task, description, _ = entry(out, "task=")
    assert task == "task=train" and {task.value for task in Task} <= set(description.split()), description
    assert "name=${task}" in out  # a value as the config holds it, its $ left alone by Hydra's template filling
    for internal in ("search.trial", "search.storage", "search.study_name", "search.num_threads"):
        assert internal not in out, internal


def test_a_description_is_the_comment_in_conf_config_yaml(user):
    config = user.repo / "conf" / "config.yaml"
    seed_comment = next(line for line in config.read_text().splitlines() if line.startswith("seed:")).split("#", 1)[1]
    assert entry(user.run("python run.py --help").stdout, "seed=")[1] == seed_comment.strip()
    # Edit the source and the help follows: there is no second copy to forget.
    text = config.read_text().replace(seed_comment, " the seed of everything random")
    config.write_text(re.sub(r"(- data: digits\s+#).*", r"\1 where the samples come from", text))
    out = user.run("python run.py --help").stdout
    assert entry(out, "seed=")[1] == "the seed of everything random"
    assert entry(out, "data:")[1] == "where the samples come from"


def test_help_shows_what_the_command_would_run(cli):
    out = cli("experiment=digits_cnn", "lr=0.005", "--help").stdout
    assert "cnn*" in entry(out, "model:")[2].split(", ")
    assert "digits_cnn*" in entry(out, "experiment:")[2].split(", ")
    assert entry(out, "lr=")[0] == "lr=0.005"
