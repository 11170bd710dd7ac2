"""benchmarks/gpu_check.sh on a machine without a GPU: one clear line and exit 2, before it runs anything."""
from __future__ import annotations

import subprocess

from conftest import REPO


def test_without_a_gpu_the_check_says_so_in_one_line_and_runs_nothing(user, tmp_path):
    scratch = tmp_path / "scratch"  # where the check would keep its runs and logs
    scratch.mkdir()
    result = user.run("bash benchmarks/gpu_check.sh", env={"TMPDIR": str(scratch), "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == ["gpu_check.sh: no CUDA GPU here (torch.cuda.is_available() is False); "
                                          "run it on a machine with one."]
    assert not list(scratch.iterdir()) and not (user.repo / "outputs").exists()


def test_the_check_is_a_valid_bash_script():
    result = subprocess.run(["bash", "-n", str(REPO / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
