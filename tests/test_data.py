import numpy as np
import pytest
import torch

from PIL import Image

from conftest import composed
from framework.errors import ConfigError
from framework.data import (BatchPlan, build_data, keep_classes, load_digits_arrays, per_class, split_indices,
                            standardize)


def test_digits_come_from_the_bundled_file_unchanged():
    from sklearn.datasets import load_digits

    x, y = load_digits_arrays()
    reference = load_digits()
    assert x.shape == (1797, 1, 8, 8)
    np.testing.assert_array_equal(x.reshape(1797, 64), reference.data.astype(np.float32))
    np.testing.assert_array_equal(y, reference.target)


def test_split_is_fixed_by_its_seed_and_disjoint():
    a, b = split_indices(100, 0.2, 0.1, seed=0), split_indices(100, 0.2, 0.1, seed=0)
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    train, val, test = a
    assert (len(train), len(val), len(test)) == (70, 20, 10)
    assert len(set(train) | set(val) | set(test)) == 100


def test_standardize_uses_train_statistics_only():
    train, other = standardize(np.arange(12, dtype=np.float32).reshape(4, 3), np.zeros((2, 3), np.float32))
    np.testing.assert_allclose(train.mean(0), 0, atol=1e-6)
    np.testing.assert_allclose(train.std(0), 1, atol=1e-6)
    assert (other < 0).all()


def test_keep_classes_relabels_in_listed_order():
    x, y = keep_classes(np.arange(6)[:, None], np.array([5, 0, 7, 5, 9, 7]), [7, 5])
    assert y.tolist() == [1, 0, 1, 0]
    assert x[:, 0].tolist() == [0, 2, 3, 5]


def test_batch_plan_is_seeded_drops_the_last_partial_batch_and_shards_per_rank():
    plan = BatchPlan(10, 4, shuffle=True, seed=3)
    batches = list(plan)
    assert [len(b) for b in batches] == [4, 4]
    assert all(torch.equal(u, v) for u, v in zip(batches, BatchPlan(10, 4, shuffle=True, seed=3)))
    plan.set_epoch(1)
    assert not torch.equal(batches[0], next(iter(plan)))
    ranks = [list(BatchPlan(10, 4, shuffle=True, seed=3, rank=r, world_size=2)) for r in (0, 1)]
    for step, whole in enumerate(batches):
        assert torch.equal(torch.cat([ranks[0][step], ranks[1][step]]), whole)


def test_eval_plan_covers_every_sample_once_across_ranks():
    shards = [torch.cat(list(BatchPlan(11, 4, shuffle=False, rank=r, world_size=2))) for r in (0, 1)]
    assert sorted(torch.cat(shards).tolist()) == list(range(11))


def test_batch_size_that_does_not_divide_among_processes_is_refused():
    with pytest.raises(ConfigError, match="batch_size=5 does not divide among 2 processes"):
        BatchPlan(10, 5, shuffle=True, world_size=2)


def test_synthetic_data_has_the_configured_shape():
    cfg = composed("data=synthetic", "data.num_samples=200", "data.input_shape=[1,6,6]", "data.num_classes=3")
    bundle = build_data(cfg.data, seed=0)
    assert bundle.input_shape == (1, 6, 6) and bundle.output_size == 3
    assert len(bundle.train) + len(bundle.val) + len(bundle.test) == 200


def write_csv(path, rows=300, label="label"):
    rng = np.random.default_rng(0)
    lines = [f"a,b,{label}"]
    for _ in range(rows):
        cls = int(rng.integers(0, 2))
        lines.append(f"{rng.normal(cls * 3):.4f},{rng.normal():.4f},{'yes' if cls else 'no'}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_csv_file_trains_with_string_labels(train, tmp_path):
    path = write_csv(tmp_path / "my.csv")
    metrics, _ = train("data=csv", f"data.path={path}", "batch_size=16", "trainer.max_epochs=6", "lr=1e-2")
    assert metrics["val/acc"] >= 0.8


@pytest.mark.parametrize("suffix", [".pt", ".npz"])
def test_tensor_files_train(train, tmp_path, suffix):
    x, y = torch.randn(80, 4), torch.randint(0, 2, (80,))
    x[:, 0] += 4 * y
    path = tmp_path / f"data{suffix}"
    if suffix == ".pt":
        torch.save({"x": x, "y": y}, path)
    else:
        np.savez(path, x=x.numpy(), y=y.numpy())
    metrics, _ = train("data=tensors", f"data.path={path}", "batch_size=8", "trainer.max_epochs=5", "lr=1e-2")
    assert metrics["val/acc"] >= 0.8


def test_dataloader_path_trains_exactly_like_the_in_memory_path(train):
    fast, fast_dir = train("data.loader=memory")
    streamed, streamed_dir = train("data.loader=dataloader")
    for key in ("train/loss", "val/loss", "val/acc"):
        assert fast[key] == pytest.approx(streamed[key], abs=1e-6), key


def test_per_class_keeps_the_first_n_of_each_class_in_the_given_order():
    y = np.array([0, 1, 0, 1, 0, 1, 2])
    assert per_class(np.array([4, 5, 0, 6, 2, 3, 1]), y, 2).tolist() == [4, 5, 0, 6, 3]
    assert per_class(np.arange(7), y, 0).tolist() == list(range(7))


def test_train_per_class_is_a_small_labelled_budget_and_leaves_val_and_test_alone():
    budget = build_data(composed("data.classes=[5,6,7,8,9]", "data.train_per_class=3").data, seed=0)
    full = build_data(composed("data.classes=[5,6,7,8,9]").data, seed=0)
    assert len(budget.train) == 15 and torch.bincount(budget.train.tensors[1]).tolist() == [3] * 5
    assert budget.classes == ["5", "6", "7", "8", "9"] and torch.equal(budget.test.tensors[1], full.test.tensors[1])


def test_class_names_come_from_the_data(tmp_path):
    path = write_csv(tmp_path / "my.csv")
    assert build_data(composed("data=csv", f"data.path={path}").data, seed=0).classes == ["no", "yes"]
    with pytest.raises(ConfigError, match=r"data.classes=\[3, 12\] lists 12, which is not a label of this data; its labels are 0..9"):
        build_data(composed("data.classes=[3,12]").data, seed=0)


def write_images(root, sizes):
    """Random RGB PNGs: root/<class>/<n>.png, one per (class, width, height)."""
    rng = np.random.default_rng(0)
    for n, (name, width, height) in enumerate(sizes):
        (root / name).mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(root / name / f"{n}.png")
    return root


def test_an_image_folder_is_split_by_fraction_and_transformed_to_one_size(tmp_path):
    root = write_images(tmp_path / "images", [(name, 20 + n % 3 * 7, 30 - n % 2 * 9) for n in range(20) for name in ("dog", "cat")])
    cfg = composed("data=imagefolder", f"data.root={root}", "data.transforms.resize=16", "data.transforms.crop=12",
                   "data.transforms.flip=true", "data.transforms.grayscale=true", "data.transforms.mean=[0.5]",
                   "data.transforms.std=[0.25]").data
    bundle = build_data(cfg, seed=0)
    assert bundle.classes == ["cat", "dog"] and bundle.input_shape == (1, 12, 12)
    assert (len(bundle.train), len(bundle.val), len(bundle.test)) == (28, 6, 6)
    def images(split, epoch):
        if split.set_epoch:
            split.set_epoch(epoch)
        return torch.stack([split[i][0] for i in range(4)])

    x = images(bundle.train, 1)
    assert x.shape == (4, 1, 12, 12) and torch.equal(x, images(bundle.train, 1))  # seeded by epoch and sample
    assert not torch.equal(x, images(bundle.train, 2))
    assert bundle.val.set_epoch is None and torch.equal(images(bundle.val, 0), images(bundle.val, 3))  # evaluation does not augment


def test_images_that_cannot_be_read_or_come_out_in_two_sizes_fail_in_one_line(tmp_path):
    root = write_images(tmp_path / "images", [("a", 8, 8), ("b", 8, 10)] * 3)
    with pytest.raises(ConfigError, match="come out in different sizes .* set data.transforms.crop"):
        build_data(composed("data=imagefolder", f"data.root={root}").data, seed=0)
    with pytest.raises(ConfigError, match="smaller than data.transforms.crop=9 after resizing"):
        build_data(composed("data=imagefolder", f"data.root={root}", "data.transforms.crop=9").data, seed=0)
    (root / "a" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(ConfigError, match="broken.png is not a readable image"):
        build_data(composed("data=imagefolder", f"data.root={root}", "data.transforms.crop=8").data, seed=0)


@pytest.mark.parametrize("overrides, message", [
    (["data.transforms.flip=true"], "data.transforms is not a key of data=digits; its keys are: batch_size,"),
    (["data=imagefolder", "data.root=.", "data.classes=[1,2]"], "data.classes is not a key of data=imagefolder"),
    (["data.train_per_class=-1"], "data.train_per_class=-1 is invalid"),
    (["data=imagefolder"], "data.root is empty"),
    (["data=imagefolder", "data.root=.", "data.transforms.mean=[0.5]", "data.transforms.std=[0.5]"],
     "give 3 values each (one per channel"),
])
def test_image_and_budget_settings_that_cannot_work_are_refused(train, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        train(*overrides)


def test_a_data_config_from_before_options_named_their_reader_reads_as_its_source():
    """Checkpoints written when data.source chose the reader still evaluate, export and fine-tune."""
    from omegaconf import OmegaConf

    current = OmegaConf.to_container(composed().data, resolve=True, enum_to_str=True)
    earlier = OmegaConf.create({**{k: v for k, v in current.items() if k != "_target_"}, "source": "digits",
                                "num_samples": 4096, "path": ""})  # that config held every source's keys
    now, then = build_data(OmegaConf.create(current), seed=0), build_data(earlier, seed=0)
    assert torch.equal(now.train.tensors[0], then.train.tensors[0]) and torch.equal(now.test.tensors[1], then.test.tensors[1])
    with pytest.raises(ConfigError, match=r"names no reader \(data._target_\) and no known data.source \('mnist'\)"):
        build_data(OmegaConf.create({**earlier, "source": "mnist"}), seed=0)
