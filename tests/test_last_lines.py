"""One numbering for steps and epochs in every message: epochs count from 1, a step mid-epoch is in
the epoch in progress, a step at an epoch's end in the epoch just ended."""
import re

from conftest import read_metrics
from test_faults import trained_in_process

QUICK = ["logger=none", "trainer.progress_bar=false"]


def messages(result):
    return [line.split(" - ", 1)[1] for line in result.stdout.splitlines() if " - " in line]


def test_a_max_steps_stop_and_its_resume_number_the_step_alike(cli, user):
    # The stop in-process (one process start fewer), its lines read from its train.log; the resume typed.
    trained_in_process(user, "trainer.max_steps=5", "trainer.max_epochs=2", "trainer.progress_bar=false")
    (first,) = user.runs()
    lines = [line.split(" - ", 1)[1] for line in (first / "train.log").read_text().splitlines() if " - " in line]
    assert any(re.fullmatch(r"epoch 1  step 5  train/loss .*", line) for line in lines), lines
    assert "Stopped: reached trainer.max_steps=5, at step 5 (epoch 1), after" in "\n".join(lines)
    resumed = cli("trainer.max_epochs=2", "trainer.progress_bar=false", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"Resumed from {first.relative_to(user.repo)}/checkpoints/last.pt at step 5 (epoch 1)." in messages(resumed)
    second = user.runs()[-1]
    assert read_metrics(second)["step"] == 38
    # One TensorBoard run for the training: the resumed run logs on in the first one's.
    assert (second / "tensorboard").resolve() == (first / "tensorboard").resolve()


# docs/oom.md's try-it command, which tests/test_readme.py leaves to the test below.
DOCS_OOM = "python run.py troubleshoot.inject_oom_above_batch=16 trainer.max_epochs=2"


def test_the_oom_injection_and_the_graph_trace_print_no_raw_warning(user):
    result = user.run(DOCS_OOM)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Warning" not in result.stderr, result.stderr[-2000:]
    assert "Out of memory at micro-batch 64" in result.stdout  # it did back off, and the graph was traced (TensorBoard is on)
