"""trainer.compile: torch.compile where each parallel mode's wrap puts it (framework/parallel/).

Most tests compile with aot_eager (seconds, and the same numbers as eager up to float rounding)
through a backend of their own that records each graph torch.compile hands it, so a run that
silently stayed eager fails. One test compiles with inductor, on the smallest MLP. Losses and
weights are compared with parallel=none's as tests/test_parallel.py compares the parallel modes:
every step's running loss and the final weights, within 1e-5 (aot_eager) and 1e-4 (inductor,
which fuses and reorders float32 arithmetic).
"""
from __future__ import annotations

import copy
from typing import List

import pytest
import torch
from torch import nn
from torch._dynamo import register_backend
from torch._dynamo.backends.registry import lookup_backend

from framework.checkpoint import load_checkpoint
from framework.errors import ConfigError
from framework.model import MLP
from framework.parallel import Compile, Environment, unwrap
from test_parallel import (EXACT, assert_same_training, final_weights, free_port, reference,  # noqa: F401 (a fixture)
                           running_losses)

COUNTED = "runlab_tests_counted"  # aot_eager, recording the graphs it compiles
GRAPHS: List[torch.fx.GraphModule] = []


@register_backend(name=COUNTED)
def counted(graph: torch.fx.GraphModule, example_inputs):
    GRAPHS.append(graph)
    return lookup_backend("aot_eager")(graph, example_inputs)


COMPILED = ["trainer.compile=true", f"trainer.compile_backend={COUNTED}"]


def forget_compiled() -> None:
    """From here on, runs compile anew: torch keeps compiled code by the model's code, across runs."""
    torch.compiler.reset()
    GRAPHS.clear()


@pytest.fixture(autouse=True)
def fresh_compiler():
    forget_compiled()
    yield
    torch.compiler.reset()


def linears(graph: torch.fx.GraphModule) -> int:
    return sum(node.target is torch.nn.functional.linear for node in graph.graph.nodes)


def model_graphs() -> List[torch.fx.GraphModule]:
    """The compiled graphs that hold the whole MLP (model=mlp: 3 linear layers)."""
    return [graph for graph in GRAPHS if linears(graph) == 3]


def test_a_compiled_run_trains_as_eager_and_its_checkpoint_has_the_plain_names(train, reference):
    _, run_dir = train(*EXACT, *COMPILED)
    assert model_graphs()  # it did compile the model
    assert_same_training(run_dir, reference, tolerance=1e-5)  # the same keys too: no "_orig_mod." prefix


def test_compiled_and_eager_checkpoints_resume_each_other_and_fine_tune(train, reference):
    one_epoch = [*EXACT, "trainer.max_epochs=1"]
    _, compiled = train(*one_epoch, *COMPILED)
    _, eager = train(*one_epoch)
    _, resumed_eager = train(*EXACT, f"resume={compiled / 'checkpoints/last.pt'}")
    assert "trainer.compile: True -> False" in (resumed_eager / "train.log").read_text()
    forget_compiled()
    _, resumed_compiled = train(*EXACT, *COMPILED, f"resume={eager / 'checkpoints/last.pt'}")
    assert model_graphs()
    for run_dir in (resumed_eager, resumed_compiled):
        for name, value in final_weights(reference).items():
            torch.testing.assert_close(final_weights(run_dir)[name], value, rtol=0, atol=1e-5, msg=name)
    # finetune.strict (the default) refuses a checkpoint whose names are not the model's.
    tuned, _ = train(*one_epoch, f"finetune.from={compiled}", "lr=1e-9")
    assert tuned["val/loss"] == pytest.approx(load_checkpoint(compiled / "checkpoints/last.pt")["metrics"]["val/loss"],
                                              abs=1e-4)


def test_out_of_memory_back_offs_compile_a_bounded_number_of_graphs(train):
    """Each back-off halves the micro-batch; torch recompiles once with the batch dimension dynamic
    and reuses that graph for the sizes after it, so more steps and more back-offs add no graphs."""
    metrics, _ = train(*COMPILED, "logger=none", "trainer.max_epochs=1", "troubleshoot.inject_oom_above_batch=32")
    assert metrics["troubleshoot/oom_backoffs"] == 1 and metrics["troubleshoot/micro_batch"] == 32
    one_back_off = len(model_graphs())
    forget_compiled()
    metrics, _ = train(*COMPILED, "logger=none", "trainer.max_epochs=3", "troubleshoot.inject_oom_above_batch=16",
                       "batch_size=256")
    assert metrics["troubleshoot/oom_backoffs"] == 4 and metrics["troubleshoot/micro_batch"] == 16
    # The train graph and the eval graph, then one with the batch dimension dynamic (the last eval batch).
    assert 1 <= one_back_off == len(model_graphs()) <= 4 and len(model_graphs()) == len(GRAPHS)


def test_inductor_compiles_the_smallest_mlp_to_eager_gradients():
    """A step of the smallest MLP through parallel=none's wrap: inductor's first compile takes
    half a minute on 2 cores (a C++ build), so this test compiles one graph and no run."""
    torch.manual_seed(0)
    eager = MLP(input_shape=(4,), num_classes=3, width=8, depth=1, dropout=0.0, batch_norm=False)
    model = Environment(torch.device("cpu"), compile=Compile("inductor", None)).wrap(copy.deepcopy(eager))
    inputs, target = torch.randn(16, 4), torch.randint(0, 3, (16,))
    losses = [nn.functional.cross_entropy(m(inputs), target) for m in (eager, model)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-4)
    for (name, parameter), compiled_parameter in zip(eager.named_parameters(), unwrap(model).parameters()):
        torch.testing.assert_close(compiled_parameter.grad, parameter.grad, rtol=0, atol=1e-4, msg=name)
    assert model is not unwrap(model)  # it was compiled


def test_the_pipeline_compiles_each_stage_and_trains_as_one_device(train, reference):
    _, run_dir = train(*EXACT, *COMPILED, "parallel=model")
    assert {linears(graph) for graph in GRAPHS} == {1, 2}  # stage 0: flatten, block0; stage 1: block1, head
    assert_same_training(run_dir, reference, tolerance=1e-5)


@pytest.mark.timeout(240)
def test_ddp_compiles_the_module_inside_ddp_and_trains_as_one_device(train, reference):
    # aot_eager by name: the spawned processes do not have this file's backend.
    _, run_dir = train(*EXACT, "trainer.compile=true", "trainer.compile_backend=aot_eager", "parallel=ddp",
                       "parallel.world_size=2", "trainer.accumulate_grad_batches=2")
    assert_same_training(run_dir, reference, tolerance=1e-5)


@pytest.mark.timeout(240)
def test_fsdp_compiles_each_block_and_its_checkpoint_resumes_eager_under_none_and_fine_tunes(train, reference):
    one_epoch = [*EXACT, "trainer.max_epochs=1"]
    _, compiled = train(*one_epoch, "trainer.compile=true", "trainer.compile_backend=aot_eager", "parallel=fsdp",
                        "parallel.world_size=2", "trainer.accumulate_grad_batches=2")
    losses = running_losses(compiled)  # the first epoch's: those of parallel=none, and so of eager fsdp
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(running_losses(reference)[:len(losses)]), rtol=0,
                               atol=1e-5)
    assert list(final_weights(compiled)) == list(final_weights(reference))  # no "_orig_mod." in the names
    _, resumed = train(*EXACT, f"resume={compiled / 'checkpoints/last.pt'}")  # parallel=none, compile off
    for name, value in final_weights(reference).items():
        torch.testing.assert_close(final_weights(resumed)[name], value, rtol=0, atol=1e-5, msg=name)
    tuned, _ = train(*one_epoch, f"finetune.from={compiled}", "lr=1e-9")
    assert tuned["val/loss"] == pytest.approx(load_checkpoint(compiled / "checkpoints/last.pt")["metrics"]["val/loss"],
                                              abs=1e-4)


def test_fsdp_back_offs_and_steps_compile_a_bounded_number_of_graphs_per_block(train, reference, monkeypatch):
    """One fsdp process in this one, as torchrun's only rank, so that this file's backend sees the graphs.
    A training step that runs out of memory ends an fsdp run; evaluation halves its batch (1024 -> 128)
    as under none. Each block is compiled on its own, and recompiled at most a bounded few times (the
    batch dimension made dynamic, eval's no-grad): a second run, resumed from the first's compiled
    checkpoint, compiles as many graphs, and ends on the uninterrupted run's weights."""
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(name, value)
    fsdp = [*EXACT, *COMPILED, "parallel=fsdp", "troubleshoot.inject_oom_above_batch=128"]
    metrics, first = train(*fsdp, "trainer.max_epochs=1")
    assert metrics["troubleshoot/eval_backoffs"] == 3 and metrics["troubleshoot/oom_backoffs"] == 0
    assert {linears(graph) for graph in GRAPHS} == {1}  # block0, block1 and head, each compiled alone
    first_graphs = len(GRAPHS)
    forget_compiled()
    _, resumed = train(*fsdp, f"resume={first / 'checkpoints/last.pt'}")
    assert 3 <= len(GRAPHS) == first_graphs <= 3 * 4
    for name, value in final_weights(reference).items():
        torch.testing.assert_close(final_weights(resumed)[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.compile_backend=nope"], r"trainer.compile_backend='nope' is not a torch.compile backend; use inductor"),
    (["trainer.compile_mode=fastest"], r"trainer.compile_mode='fastest' is invalid: Unrecognized mode=fastest"),
    (["trainer.compile_backend=aot_eager", "trainer.compile_mode=max-autotune"],
     r"trainer.compile_mode='max-autotune' is inductor's; it does not apply to compile_backend=aot_eager"),
    (["parallel=dp"], r"trainer.compile=true is not supported with parallel=dp"),
])
def test_impossible_compile_settings_are_refused_in_one_sentence(train, overrides, message):
    with pytest.raises(ConfigError, match=message):
        train("trainer.compile=true", *overrides)


def test_a_user_compiles_from_the_command_line(cli, user):
    result = cli("trainer.compile=true", "trainer.compile_backend=aot_eager", "trainer.max_epochs=1",
                 "trainer.progress_bar=false")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Best val/acc" in result.stdout and "could not trace" not in result.stdout + result.stderr
    checkpoint = load_checkpoint(user.runs()[-1] / "checkpoints" / "last.pt")
    assert not [name for name in checkpoint["model"] if "_orig_mod" in name]
