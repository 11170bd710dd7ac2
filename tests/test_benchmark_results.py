"""benchmarks/RESULTS.md is written by the benchmark scripts themselves (benchmarks/results.py)."""
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import results  # noqa: E402


def test_a_benchmark_run_appends_what_it_printed_with_its_command_date_commit_and_machine(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results, "RESULTS", tmp_path / "RESULTS.md")
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / "startup.py"), "--repeats", "1"])
    with results.recorded():
        print("run.py max_steps=1 - Hydra app 1 step = +0.12 s (target <= +0.15 s)")
    text = (tmp_path / "RESULTS.md").read_text()
    assert "### `python benchmarks/startup.py --repeats 1`" in text
    assert "commit " in text and "CPU cores" in text and "torch " in text
    assert "```text\nrun.py max_steps=1 - Hydra app 1 step = +0.12 s (target <= +0.15 s)\n```" in text
    assert "run.py max_steps=1 - Hydra app 1 step" in capsys.readouterr().out  # still printed


def test_a_benchmark_that_fails_records_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path / "RESULTS.md")
    try:
        with results.recorded():
            print("half a table")
            raise RuntimeError("the benchmark broke")
    except RuntimeError:
        pass
    assert not (tmp_path / "RESULTS.md").exists()
