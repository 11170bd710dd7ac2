"""The README's and the docs pages' commands, verbatim, in a fresh copy of the repository.

The commands are read from README.md, then from each page of docs/ in the order of mkdocs.yml's
nav, so the documents and the tests cannot drift apart:

- a ```bash block: every line is a command (a trailing `\\` continues it) and must exit 0. A
  line whose comment starts with `needs:` (`# needs: 2 GPUs`) cannot run on this machine and
  is skipped, with that reason; `tensorboard ...` starts a server, which must answer.
- a ```console block: `$ COMMAND` lines, each followed by the output it prints. Every shown
  line must appear, in order, in what the command prints (`...` stands for anything), and
  `$ echo $?` shows the exit code of the command before it.
- a ```python block runs as a script and must exit 0.

Every block runs in that order, in one copy, with .venv/bin on PATH as after
`source .venv/bin/activate`, and with nothing a user would not type. A block is named by its
file and line (`docs/training.md:120`).

The site itself is built with `mkdocs build --strict`, so a broken link or anchor between
pages fails here too, and so does a README link to a page or heading that does not exist.
"""
from __future__ import annotations

import os
import re
import shlex
import sys
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import List, Tuple

import pytest

from conftest import REPO, UserShell, copy_repository, read_metrics
from docs_pages import FENCE, STEPS, as_pattern, console_transcript, documents, typed_as_shown
from test_notebook import DOCS_ERROR, DOCS_RUN
from test_cli import DOCS_REFUSED
from test_faults import (DOCS_COMPLETE, DOCS_DIVERGED, DOCS_MOSTLY_SKIPPED, DOCS_RESUMES, DOCS_SHARED, DOCS_STOPPED,
                         README_LAST_LINES)
from test_last_lines import DOCS_OOM
from test_examples import DOCS_CHAR_LM, DOCS_DIABETES, README_OWN_DATA, README_WAVES
from test_multirun_summary import DOCS_GRID
from test_parallel import DOCS_DDP_SWEEP, DOCS_TORCHRUN
from test_sharded_checkpoints import DOCS_SHARDED_RUN
from test_search import (DOCS_BEST, DOCS_EXPORT, DOCS_EXPORTED_BEST, DOCS_RANDOM, DOCS_REPORT, DOCS_TPE,
                         DOCS_TPE_RESUMED, DOCS_TWO_OBJECTIVES)
from test_sweep_scheduling import DOCS_LR_ONLY, DOCS_NARROW_LR
from test_transfer import DOCS_FINETUNE, DOCS_LOAD, DOCS_SCRATCH

# Steps (a command as typed, or a console or python block's whole text: Step.typed) that a test of
# their own runs verbatim in a fresh copy, and checks further: not run twice (nothing later on the
# pages reads their outputs).
RUN_BY_THEIR_OWN_TEST = {
    DOCS_DDP_SWEEP: "tests/test_parallel.py::test_the_docs_ddp_sweep_gives_one_complete_run_dir_per_job",
    DOCS_TORCHRUN: "tests/test_parallel.py::test_the_docs_torchrun_command_equals_one_device_in_one_run_dir",
    DOCS_SHARDED_RUN: "tests/test_sharded_checkpoints.py::test_a_sharded_checkpoint_resumes_under_fsdp_and_in_one_process_as_the_single_file_run_goes_on",
    DOCS_RUN: "tests/test_notebook.py::test_the_docs_run_from_a_script_prints_each_epoch_and_returns_the_run",
    DOCS_ERROR: "tests/test_notebook.py::test_the_docs_run_from_a_script_prints_each_epoch_and_returns_the_run",
    DOCS_REFUSED: "tests/test_cli.py::test_a_bad_value_stops_with_one_line_and_exit_code_2",
    DOCS_DIVERGED: "tests/test_faults.py::test_a_diverging_run_stops_at_the_step_and_keeps_the_last_finite_checkpoints",
    DOCS_MOSTLY_SKIPPED: "tests/test_faults.py::test_a_run_that_skipped_most_of_its_steps_ends_non_zero_in_one_line",
    **dict.fromkeys([*DOCS_RESUMES, DOCS_COMPLETE, DOCS_SHARED],
                    "tests/test_faults.py::test_the_docs_resumes_continue_on_a_rebuilt_schedule_at_the_new_lr_then_end_complete_or_refused"),
    DOCS_STOPPED: "tests/test_faults.py::test_a_live_run_holds_its_lock_and_resume_auto_refuses_it",
    DOCS_OOM: "tests/test_last_lines.py::test_the_oom_injection_and_the_graph_trace_print_no_raw_warning",
    README_LAST_LINES: "tests/test_faults.py::test_the_last_lines_of_a_run_say_where_everything_is",
    **dict.fromkeys([DOCS_FINETUNE, DOCS_SCRATCH, DOCS_LOAD],
                    "tests/test_transfer.py::test_the_example_pair_beats_the_same_budget_from_scratch_by_5_points_as_a_user_types_it"),
    DOCS_GRID: "tests/test_multirun_summary.py::test_the_docs_grid_ends_with_its_jobs_and_the_best_one",
    DOCS_RANDOM: "tests/test_search.py::test_the_docs_random_sweep_runs_n_trials_and_writes_its_report",
    DOCS_TPE: "tests/test_search.py::test_the_docs_tpe_study_resumes_reports_and_its_best_trial_reproduces_the_best_value",
    DOCS_TPE_RESUMED: "tests/test_search.py::test_the_docs_tpe_study_resumes_reports_and_its_best_trial_reproduces_the_best_value",
    DOCS_REPORT: "tests/test_search.py::test_the_docs_tpe_study_resumes_reports_and_its_best_trial_reproduces_the_best_value",
    DOCS_BEST: "tests/test_search.py::test_the_docs_tpe_study_resumes_reports_and_its_best_trial_reproduces_the_best_value",
    DOCS_EXPORT: "tests/test_search.py::test_the_docs_tpe_study_resumes_reports_and_its_best_trial_reproduces_the_best_value",
    DOCS_EXPORTED_BEST: "tests/test_search.py::test_the_docs_tpe_study_resumes_reports_and_its_best_trial_reproduces_the_best_value",
    DOCS_TWO_OBJECTIVES: "tests/test_search.py::test_the_docs_in_memory_sweep_of_two_objectives_reports_its_pareto_front",
    DOCS_NARROW_LR: "tests/test_sweep_scheduling.py::test_the_docs_spaces_make_their_studies_and_the_same_command_with_another_space_is_refused_in_one_line",
    DOCS_LR_ONLY: "tests/test_sweep_scheduling.py::test_the_docs_spaces_make_their_studies_and_the_same_command_with_another_space_is_refused_in_one_line",
    **dict.fromkeys([DOCS_DIABETES, DOCS_CHAR_LM, README_WAVES],
                    "tests/test_examples.py::test_an_example_trains_and_resumes_exactly_after_an_interruption"),
    README_OWN_DATA: "tests/test_examples.py::test_the_readmes_own_dataset_model_and_loss_train_under_ddp_as_in_one_process",
}

SERVING = re.compile(r"TensorBoard \S+ at (http://\S+/) ")


def serve_tensorboard(user: UserShell, command: str, log: Path, where: str) -> None:
    """The server answers at the address it prints (6006, or the next free port: other tests may
    hold 6006)."""
    server = user.start(command, log)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, f"{where}: `{command}` exited:\n{log.read_text()[-3000:]}"
            printed = SERVING.search(log.read_text())
            try:
                with urllib.request.urlopen(printed.group(1), timeout=5) as page:
                    assert page.status == 200
                    return
            except (OSError, AttributeError):  # not serving yet, or not yet said where
                assert time.monotonic() < deadline, f"{where}: `{command}` did not answer:\n{log.read_text()[-3000:]}"
                time.sleep(0.5)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture(scope="module")
def reader(tmp_path_factory) -> UserShell:
    """One fresh copy for the README and the pages, read top to bottom (later commands use earlier runs)."""
    return UserShell(copy_repository(tmp_path_factory.mktemp("readme") / "runlab"))


def test_the_readme_format_is_understood():
    commands = [step.typed for step in STEPS if step.command and not step.needs]
    assert len(commands) >= 20 and "python run.py -m lr=1e-3,1e-4" in commands
    assert set(RUN_BY_THEIR_OWN_TEST) <= {step.typed for step in STEPS if not step.needs}  # each still a step, its test still named
    assert all(name.split("::")[1] in (REPO / name.split("::")[0]).read_text() for name in RUN_BY_THEIR_OWN_TEST.values())
    readme = [step.typed for step in STEPS if step.block.file == "README.md" and step.command]
    assert {"python run.py parallel=ddp", "python run.py -m lr=1e-3,1e-4", "python run.py experiment=digits_cnn",
            "make run", "make test"} <= set(readme)  # the card's commands, on the README itself
    assert len(documents()) > 10 and all((REPO / page).is_file() for page in documents())
    assert all(console_transcript(s.block.text).commands for s in STEPS if s.block.kind == "console")
    assert as_pattern("micro-batch ... fits").search("micro-batch 4096 fits")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("step", STEPS, ids=[step.id for step in STEPS])
def test_readme_step_works_verbatim_in_a_fresh_copy(reader, step, tmp_path):
    where = step.block.where
    if step.needs:
        pytest.skip(f"needs {step.needs}")
    if step.typed in RUN_BY_THEIR_OWN_TEST:
        pytest.skip(f"run by {RUN_BY_THEIR_OWN_TEST[step.typed]}")
    if step.block.kind == "console":
        typed_as_shown(reader, step.block.text, where, one_terminal=True)
    elif step.block.kind == "python":
        done = reader.run(f"python -c {shlex.quote(step.block.text)}", timeout=500)
        assert done.returncode == 0, f"{where}: the python block failed:\n{done.stderr[-3000:]}"
    elif step.command.startswith("tensorboard "):
        serve_tensorboard(reader, step.command, tmp_path / "tensorboard.log", where)
    else:
        done = reader.run(step.command, timeout=500)
        assert done.returncode == 0, f"{where}: `{step.command}` exited {done.returncode}:\n" \
                                     f"{(done.stdout + done.stderr)[-3000:]}"


def extending_example() -> Tuple[List[Tuple[str, str]], str]:
    """The docs' worked example of a new option (docs/extending.md): the (kind, text) of the blocks
    that add to a file, each naming the file on its first line, and the command that uses the option."""
    text = (REPO / "docs" / "extending.md").read_text()
    section = text[text.index("\n## A worked example"):]
    blocks = [(match.group(1), match.group(2)) for match in FENCE.finditer(section)]
    return [(kind, body) for kind, body in blocks if kind in ("py", "yaml")], next(b for k, b in blocks if k == "sh").strip()


@pytest.mark.timeout(600)
def test_the_extending_example_adds_a_data_source_in_a_fresh_copy(user):
    files, command = extending_example()
    assert [kind for kind, _ in files] == ["py", "py", "yaml"]
    for kind, body in files:
        path = user.repo / body.splitlines()[0].removeprefix("#").strip()
        if kind == "py":  # added at the end of a module
            path.write_text(path.read_text() + "\n\n" + body)
        else:
            assert not path.exists()
            path.write_text(body)
    done = user.run(command, timeout=500)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (run_dir,) = user.runs("train")
    assert read_metrics(run_dir)["test/acc"] > 0.9  # two half circles, learnt by the default MLP
    refused = user.run("python run.py data=moons data.root=x")
    assert refused.returncode == 2 and "data.root is not a key of data" in refused.stderr
    assert "moons" in user.run("python run.py --help").stdout


def test_the_docs_site_builds_strictly(tmp_path):
    """mkdocs-material's build with --strict: a link to a missing page or anchor is an error."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert (tmp_path / "site" / "training" / "index.html").is_file()


def heading_anchors(page: Path) -> set:
    """The ids mkdocs gives a page's headings (Python-Markdown's toc slugify), outside code blocks."""
    from markdown.extensions.toc import slugify

    text = FENCE.sub("", page.read_text())
    return {slugify(re.sub(r"[`*]", "", line.lstrip("#").strip()), "-") for line in text.splitlines() if line.startswith("#")}


def test_the_readme_links_to_pages_and_headings_that_exist():
    """mkdocs does not build README.md, so its links into docs/ are checked here."""
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", (REPO / "README.md").read_text())
    assert len(links) > 10
    for page, anchor in links:
        assert (REPO / page).is_file(), f"README.md links to {page}, which does not exist"
        assert not anchor or anchor in heading_anchors(REPO / page), f"README.md links to {page}#{anchor}: no such heading"
