"""Images past one folder (issue 37): file lists saved once and reused, shards read by index.

A split's file list is built once and reused without listing the tree; a tree changed since, a
damaged list or one from another tree stops with one line and is rebuilt only when asked; a file
changed in place is caught when it is decoded. Shards (litdata) give the batches, evaluation and
model of loose files, from a folder or through a node-local cache whose size is bounded; bad shards
(truncated, missing, another dataset's, out of order) stop with one line naming the file and the
fix, exit 2, leaving what was saved as it was. The recipes run here in this process
(``tests/recipe_probe.py``) but for the exit code, the SIGKILL chain and the 2-rank list build.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import litdata.streaming.config as litdata_config
import litdata.streaming.item_loader as litdata_item_loader
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

from common.config import Decode, TrainerConfig
from common.data import decode_choice
from common.data.decode_choice import choose_train_decode
from common.data.device_input import DeviceTrainInput
from common.data.file_index import FileIndex
from common.data.images import TrainAugmentation, TrainImages, collate_train
from common.data.loaders import PerSampleSeeded, make_train_loader
from common.data.sampler import ResumableDistributedSampler
from common.data.shards import ShardImages, write_shards
from common.errors import UserError
from recipes.timm_imagenet import data as timm_data
from recipes.timm_imagenet.config import DataConfig
from tests import trained_runs
from tests.conftest import assert_ok, read_summary, run_recipe, spawn_ranks
from tests.recipe_probe import Configs, probe, tiny_settings
from tests.resume import CHAIN_SETTINGS, kill_signal_resume
from tools.tiny_data import write_image_folder

TIMM, FUNGI = "timm_imagenet", "fungitastic"
SHARDS_FIX = "write the shards again with `make prep-timm_imagenet FORMAT=shards`"


def tree(folder: Path) -> Path:
    """A 3-class ImageFolder of 24x24 JPEGs, with one 50x30 image so that sizes differ."""
    root = write_image_folder(folder, train_per_class=3, val_per_class=1, size=24)
    Image.new("RGB", (50, 30), (200, 10, 10)).save(root / "train" / "n01440764" / "wide.JPEG")
    return root


def listed(root: Path, run_dir: Path, **settings: object) -> tuple[object, Path]:
    """timm_imagenet's training files, as train() gets them."""
    return timm_data.split_files(DataConfig(root=str(root), **settings), "train", root, str(run_dir), 0)


def fail(*args: object, **kwargs: object) -> None:
    raise AssertionError("the tree was listed again")


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``folder``: its modification time and bytes."""
    return {str(path.relative_to(folder)): (path.stat().st_mtime_ns, path.read_bytes())
            for path in sorted(folder.rglob("*")) if path.is_file()}


# ---- file lists ------------------------------------------------------------------------------------


def test_a_split_is_listed_once_in_imagefolders_order_and_a_later_start_lists_no_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tree(tmp_path / "data")
    files, path = listed(root, tmp_path / "run")
    assert path == root / "train.index.npz"
    folder = ImageFolder(str(root / "train"))
    assert files.paths == [sample for sample, _ in folder.samples]
    assert files.labels.tolist() == folder.targets
    sizes = [Image.open(sample).size for sample, _ in folder.samples]
    assert list(zip(files.index.widths.tolist(), files.index.heights.tolist())) == sizes
    assert (50, 30) in sizes

    for module, name in ((timm_data, "make_dataset"), (timm_data, "find_classes"), (os, "scandir"), (os, "listdir")):
        monkeypatch.setattr(module, name, fail)
    again, again_path = listed(root, tmp_path / "run")
    assert again_path == path and again.index.checksum() == files.index.checksum()


def test_a_changed_tree_stops_with_one_line_and_is_listed_again_only_when_asked(tmp_path: Path) -> None:
    root = tree(tmp_path / "data")
    _, path = listed(root, tmp_path / "run")
    saved = path.read_bytes()
    shutil.copy(root / "train" / "n01441764" / "n01441764_0.JPEG", root / "train" / "n01441764" / "added.JPEG")
    with pytest.raises(UserError) as stopped:
        listed(root, tmp_path / "run")
    line = str(stopped.value)
    assert "\n" not in line and line.startswith(f"{root} changed since its file list {path} was saved: ")
    assert "train/n01441764/ changed (3 entries then, 4 now)" in line
    assert line.endswith("list the files again with data.rebuild_index=true (or `make prep-timm_imagenet SOURCE=...`)")
    assert path.read_bytes() == saved, "the saved list was touched"

    rebuilt, _ = listed(root, tmp_path / "run", rebuild_index=True)
    assert str(root / "train" / "n01441764" / "added.JPEG") in rebuilt.paths and len(rebuilt) == 11
    assert listed(root, tmp_path / "run")[0].index.checksum() == rebuilt.index.checksum()


@pytest.mark.parametrize("damage", ["checksum", "not a list", "another tree"])
def test_a_damaged_list_or_one_from_another_tree_stops_with_one_line_naming_it(tmp_path: Path, damage: str) -> None:
    root = tree(tmp_path / "data")
    _, path = listed(root, tmp_path / "run")
    if damage == "checksum":
        with np.load(path) as saved:
            arrays = dict(saved)
        arrays["labels"][0] += 1
        np.savez(path, **arrays)
        expected = f"{path} does not match its checksum (damaged, or written by another version); delete it, or " \
                   "list the files again with data.rebuild_index=true"
    elif damage == "not a list":
        path.write_bytes(b"not an npz file")
        expected = f"{path} is not a readable file list ("
    else:
        other = write_image_folder(tmp_path / "other", n_classes=4, train_per_class=2, val_per_class=1, size=16)
        listed(other, tmp_path / "other-run")
        shutil.copy(other / "train.index.npz", path)
        expected = f"{root} changed since its file list {path} was saved: train/, train/n01440764/, train/n01441764/"
    saved = path.read_bytes()
    with pytest.raises(UserError) as stopped:
        listed(root, tmp_path / "run")
    assert str(stopped.value).startswith(expected) and "\n" not in str(stopped.value)
    assert path.read_bytes() == saved


def test_a_read_only_data_folder_keeps_its_list_in_the_run_directory(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture) -> None:
    root = tree(tmp_path / "data")
    save = FileIndex.save

    def read_only(index: FileIndex, path: Path) -> None:
        if path.parent == root:
            raise PermissionError(13, "Permission denied", str(path))
        save(index, path)

    monkeypatch.setattr(FileIndex, "save", read_only)
    files, path = listed(root, tmp_path / "run")
    assert path == tmp_path / "run" / "index" / "train.index.npz" and not (root / "train.index.npz").exists()
    assert f"{root} cannot be written: saved its file list in {path}" in capsys.readouterr().out
    monkeypatch.setattr(timm_data, "make_dataset", fail)
    assert listed(root, tmp_path / "run")[1] == path


@pytest.mark.parametrize("decode", [Decode.cpu, Decode.gpu])  # the two decoders; auto picks one of them
def test_a_file_changed_in_place_is_caught_when_it_is_decoded(tmp_path: Path, decode: Decode) -> None:
    """Its folder keeps its modification time, so the start cannot see it; the decoded size can."""
    root = tree(tmp_path / "data")
    listed(root, tmp_path / "run")
    image, folder = root / "train" / "n01440764" / "n01440764_0.JPEG", root / "train" / "n01440764"
    times = folder.stat()
    Image.new("RGB", (30, 20)).save(image)
    os.utime(folder, ns=(times.st_atime_ns, times.st_mtime_ns))
    files, _ = listed(root, tmp_path / "run")
    augmentation = TrainAugmentation(size=16)
    position = files.paths.index(str(image))
    expected = f"{image} is about 30x20 pixels, but its file list says 24x24: the file changed after the list was " \
               "saved; list the files again with data.rebuild_index=true"
    with pytest.raises(UserError, match=expected):
        sample = TrainImages(files, augmentation, decode)[position]
        batch, _ = collate_train([sample])
        DeviceTrainInput(augmentation, decode, (0.5,) * 3, (0.5,) * 3, torch.device("cpu"))(batch)


def _list_on_a_rank(rank: int, root: str, run_dir: str, out: str) -> None:
    if rank == 0:  # a slow listing: the other rank must wait for it, not take the list already there
        list_split = timm_data.list_split
        timm_data.list_split = lambda *args: (time.sleep(2), list_split(*args))[1]
    files, path = timm_data.split_files(DataConfig(root=root, rebuild_index=True), "train", Path(root), run_dir, rank)
    Path(out, f"rank{rank}.json").write_text(json.dumps([files.index.info["token"], files.index.checksum(),
                                                         str(path)]))


@pytest.mark.slow
@pytest.mark.parametrize("there_before", ["an older list", "a damaged list"])
def test_on_two_ranks_local_rank_0_lists_and_the_other_waits_for_that_list(tmp_path: Path, there_before: str) -> None:
    """A list saved earlier is there, whole or damaged: rank 1 must wait for the one rank 0 makes now
    (rebuild_index), not take the old one nor stop on the damaged one with the line that asks for a rebuild."""
    root = tree(tmp_path / "data")
    earlier, path = listed(root, tmp_path / "run")
    if there_before == "a damaged list":
        path.write_bytes(b"not a list")
    spawn_ranks(_list_on_a_rank, str(root), str(tmp_path / "run"), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0][0] != earlier.index.info["token"]
    assert FileIndex.load(root / "train.index.npz").info["token"] == ranks[0][0]


# ---- shards ---------------------------------------------------------------------------------------


def remote(location: Path) -> str:
    return f"file://{location}"


@pytest.mark.parametrize(("recipe", "decode"), [(TIMM, "cpu"), (TIMM, "gpu"), (FUNGI, "cpu")])
def test_shards_from_a_folder_or_a_remote_give_the_batches_evaluation_and_model_of_files(
        recipe: str, decode: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    shards = (trained_runs.imagenet_shards if recipe == TIMM else trained_runs.fungi_shards)(tmp_path_factory)
    configs = Configs(recipe, tmp_path, tiny_settings(recipe, tmp_path_factory))
    common = ["trainer.max_steps=2", f"data.decode={decode}", "trainer.num_workers=1"]
    runs = {"files": probe(recipe, configs(*common), steps=None),
            "shards": probe(recipe, configs(*common, "data.format=shards"), steps=None),
            "remote": probe(recipe, configs(*common, "data.format=shards", f"data.shards.root={remote(shards)}",
                                            f"data.shards.cache_dir={tmp_path / 'cache'}"), steps=None)}
    files = runs.pop("files")
    assert files.error is None and len(files.inputs) == 2
    for name, run in runs.items():
        assert run.error is None, (name, run.error)
        assert run.sample_keys == files.sample_keys, name
        for ours, theirs in zip([*run.inputs, *run.eval_inputs], [*files.inputs, *files.eval_inputs], strict=True):
            assert torch.equal(ours, theirs), name
        assert run.summary["model_digest"] == files.summary["model_digest"], name
    assert list((tmp_path / "cache").rglob("chunk-*.bin")), "the remote's chunks were not cached"


def small_chunks(factory: pytest.TempPathFactory, out: Path) -> tuple[Path, FileIndex]:
    """The tiny ImageFolder's training split as shards of about 4 KB (a dozen chunks)."""
    root = trained_runs.imagenet_data(factory)
    trained_runs.imagenet_shards(factory)  # lists the split
    index = FileIndex.load(root / "train.index.npz")
    write_shards(index, root, out, {"recipe": TIMM, "split": "train", "classes": index.info["classes"]}, workers=1,
                 chunk_bytes="4KB")
    return out, index


def cached_bytes(cache: Path) -> int:
    return sum(path.stat().st_size for path in cache.rglob("chunk-*.bin"))


def test_a_remote_is_read_through_a_node_local_cache_bounded_by_its_limit(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two workers read every sample twice in random orders: with a limit above the set's size the
    cache ends up holding the whole set; with a limit of three chunks it holds at most that and one
    chunk more per worker at the end, and the run says that the set does not fit."""
    folder, index = small_chunks(tmp_path_factory, tmp_path / "shards")
    chunks = json.loads((folder / "index.json").read_text())["chunks"]
    assert len(chunks) >= 8
    total, largest = sum(c["chunk_bytes"] for c in chunks), max(c["chunk_bytes"] for c in chunks)
    expect = {"recipe": TIMM, "split": "train"}
    for limit in (2 * total, 3 * largest):
        cache = tmp_path / f"cache-{limit}"
        images = ShardImages(remote(folder), str(cache), str(limit), expect, "the fix")
        orders = [torch.randperm(len(images), generator=torch.Generator().manual_seed(seed)).tolist()
                  for seed in (1, 2)]
        read = [name for order in orders for batch in DataLoader(images, batch_size=4, sampler=order, num_workers=2,
                                                                  collate_fn=lambda b: [i.name for i in b])
                for name in batch]
        assert read == [f"{remote(folder)}[{i}] ({index.name(i)})" for order in orders for i in order]
        if limit > total:
            assert cached_bytes(cache) == total and "larger than the cache" not in images.describe()
        else:
            assert cached_bytes(cache) <= limit + 2 * largest < total
            assert "the set is larger than the cache's limit" in images.describe()


def test_chunks_the_main_process_never_read_are_read_by_the_forked_workers_after_decode_auto_measured(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """data.decode=auto measures the CPU's decode rate on the training shards in the main process (forced
    here: the device taken for a GPU, the model's rate given; the first chunk's samples read), then the
    loader forks its worker, which reads every sample. With a copy of the main process's reader the worker
    would wait for the chunks a download thread that a fork does not copy was to fetch (litdata's wait,
    120 s, cut to 10 here), and fail."""
    for module in (litdata_config, litdata_item_loader):
        monkeypatch.setattr(module, "_MAX_WAIT_TIME", 10)
    monkeypatch.setattr(decode_choice, "_SAMPLE_FILES", 2)
    monkeypatch.setattr(decode_choice, "model_rate", lambda *args: 1e9)
    folder, index = small_chunks(tmp_path_factory, tmp_path / "shards")
    images = ShardImages(remote(folder), str(tmp_path / "cache"), "1GB", {"recipe": TIMM}, "the fix")
    augmentation = TrainAugmentation(size=16)
    choice = choose_train_decode(Decode.auto, TrainerConfig(num_workers=1), augmentation, images, False,
                                 torch.nn.Identity(), 16, torch.device("cuda"), micro_batch=4, resumed="")
    assert choice.decode == Decode.gpu and "the model trains ~1,000,000,000 on this GPU" in choice.reason
    keys = [(0, i) for i in range(len(images))]
    loader = make_train_loader(PerSampleSeeded(TrainImages(images, augmentation, choice.decode), 0),
                               [keys[start : start + 4] for start in range(0, len(keys), 4)], 1, False,
                               collate_fn=collate_train)
    read = [path for batch, _ in loader for path in batch["path"]]
    assert read == [f"{remote(folder)}[{i}] ({index.name(i)})" for i in range(len(images))]


def test_samples_read_by_two_ranks_then_one_are_the_epochs_samples_once_each_as_files_give_them(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The resumable sampler's order through shards: 2 ranks take 2 batches of 4 each, the job comes
    back on 1 rank and takes the rest of the epoch. Every position once, each sample the image the
    loose files give for the same (epoch, index)."""
    root, shards = trained_runs.imagenet_data(tmp_path_factory), trained_runs.imagenet_shards(tmp_path_factory)
    files, _ = timm_data.split_files(DataConfig(root=str(root)), "train", root, str(root / "run"), 0)
    from_shards = ShardImages(str(shards / "train"), "", "1GB", {"recipe": TIMM}, "the fix")
    augmentation = TrainAugmentation(size=16, colour_jitter=0.4)

    def images(source: object, sampler: ResumableDistributedSampler, batches: int | None) -> list:
        loader = DataLoader(PerSampleSeeded(TrainImages(source, augmentation, Decode.cpu), seed=5), batch_size=4,
                            sampler=sampler, num_workers=1, collate_fn=collate_train)
        return [batch["image"] for _, (batch, _) in zip(range(batches or 10**6), loader)]

    ranks = [ResumableDistributedSampler(len(files), rank, 2, seed=7, yield_epoch=True) for rank in (0, 1)]
    keys, seen = [], []
    for sampler in ranks:
        sampler.set_epoch(1)
        keys.append(list(sampler)[:8])
        seen.append(torch.cat(images(from_shards, sampler, 2)))
    ranks[0].advance(8)
    alone = ResumableDistributedSampler(len(files), 0, 1, seed=7, yield_epoch=True)
    alone.load_state_dict(ranks[0].state_dict())
    rest = list(alone)
    assert sorted(index for _, index in keys[0] + keys[1] + rest) == list(range(len(files)))
    assert [key for pair in zip(*keys) for key in pair] + rest == [(1, i) for i in alone.global_order(1).tolist()]
    for sampler_keys, shard_images in [*zip(keys, seen), (rest, torch.cat(images(from_shards, alone, None)))]:
        assert torch.equal(shard_images, torch.cat(images(files, sampler_keys, None)))


def damaged_copy(tmp_path: Path, shards: Path, damage: str) -> tuple[Path, str]:
    """A copy of the tiny ImageFolder's shards with one kind of damage; the line it must stop with."""
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    chunk = copy / "train" / json.loads((copy / "train" / "index.json").read_text())["chunks"][0]["filename"]
    if damage == "truncated":
        size = chunk.stat().st_size
        os.truncate(chunk, 5000)
        return copy, f"{chunk} is truncated (5,000 of {size:,} bytes): {SHARDS_FIX}"
    if damage == "missing":
        chunk.unlink()
        return copy, f"{chunk} is missing: {SHARDS_FIX}"
    if damage == "not a shard set":
        shutil.rmtree(copy / "train")
        (copy / "train").mkdir()
        return copy, f"{copy / 'train'} holds no shard set (no index.json): write one with " \
                     "`make prep-timm_imagenet FORMAT=shards`"
    raise ValueError(damage)


@pytest.mark.parametrize("damage", ["truncated", "missing", "not a shard set"])
def test_a_truncated_or_missing_shard_stops_before_any_work_with_one_line(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, damage: str) -> None:
    copy, expected = damaged_copy(tmp_path, trained_runs.imagenet_shards(tmp_path_factory), damage)
    configs = Configs(TIMM, tmp_path, tiny_settings(TIMM, tmp_path_factory))
    for location in (str(copy), remote(copy)):
        seen = probe(TIMM, configs("data.format=shards", f"data.shards.root={location}",
                                   f"data.shards.cache_dir={tmp_path / 'cache'}"))
        assert seen.error == expected


def test_a_damaged_shard_exits_2_with_one_line_and_the_run_directory_stays_as_it_was(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A run that checkpointed, started again on a damaged shard set: its checkpoints, lists and shards untouched."""
    copy, expected = damaged_copy(tmp_path, trained_runs.imagenet_shards(tmp_path_factory), "truncated")
    settings = [*tiny_settings(TIMM, tmp_path_factory), "data.format=shards", f"run_dir={tmp_path / 'run'}",
                "trainer.max_steps=2"]
    good = trained_runs.imagenet_shards(tmp_path_factory)
    assert_ok(run_recipe(TIMM, [*settings, f"data.shards.root={good}"]))
    before = snapshot(tmp_path / "run" / "checkpoints"), snapshot(copy)
    result = run_recipe(TIMM, [*settings, f"data.shards.root={copy}", "trainer.max_steps=4"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {expected}"]
    assert (snapshot(tmp_path / "run" / "checkpoints"), snapshot(copy)) == before


def test_staging_shards_to_local_disk_is_refused_in_one_line(tmp_path: Path,
                                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """data.stage_to_local copies loose files; with shards it would be ignored without a word."""
    trained_runs.imagenet_shards(tmp_path_factory)
    configs = Configs(TIMM, tmp_path, tiny_settings(TIMM, tmp_path_factory))
    seen = probe(TIMM, configs("data.format=shards", "data.stage_to_local=true",
                               f"data.stage_dir={tmp_path / 'stage'}"))
    assert seen.error == ("data.stage_to_local=true copies data.root's loose files, which data.format=shards does not "
                          "read: drop it, and give shards on a shared filesystem as a remote (data.shards.root="
                          "file:///path), read through the node-local cache data.shards.cache_dir")
    assert not (tmp_path / "stage").exists()


def test_shards_of_another_dataset_stop_with_one_line(tmp_path: Path,
                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """Another recipe's shards, a val split of other classes, and fungitastic shards encoded with
    other label spaces than the run's."""
    timm_shards, fungi_shards = (trained_runs.imagenet_shards(tmp_path_factory),
                                 trained_runs.fungi_shards(tmp_path_factory))
    configs = Configs(TIMM, tmp_path, tiny_settings(TIMM, tmp_path_factory))
    seen = probe(TIMM, configs("data.format=shards", f"data.shards.root={fungi_shards / 'mini-300p'}"))
    assert seen.error.startswith(f"{fungi_shards / 'mini-300p' / 'train'} holds the shards of another dataset "
                                 "(recipe 'fungitastic'; this run needs recipe 'timm_imagenet'): point "
                                 "data.shards.root at this dataset's shards")

    mixed = tmp_path / "mixed"
    shutil.copytree(timm_shards / "train", mixed / "train")
    other = write_image_folder(tmp_path / "other", n_classes=4, train_per_class=2, val_per_class=1, size=16)
    from data_prep.timm_imagenet import shard

    shard(other, other / "shards", workers=1)
    shutil.copytree(other / "shards" / "val", mixed / "val")
    seen = probe(TIMM, configs("data.format=shards", f"data.shards.root={mixed}"))
    assert seen.error.startswith("the val split holds other classes than train (")

    data = trained_runs.fungi_data(tmp_path_factory)
    prepared = tmp_path / "prepared"
    shutil.copytree(data / "prepared", prepared)
    mappings_file = prepared / "FungiTastic-Mini" / "taxonomic_mappings.json"
    mappings = json.loads(mappings_file.read_text())
    mappings["name_to_index"]["genus"] = {"Russula": 0, "Amanita": 1}
    mappings_file.write_text(json.dumps(mappings))
    fungi = Configs(FUNGI, tmp_path / "fungi", tiny_settings(FUNGI, tmp_path_factory))
    seen = probe(FUNGI, fungi("data.format=shards", f"data.prepared_dir={prepared}"))
    assert seen.error.startswith(f"{fungi_shards / 'mini-300p' / 'train'} holds the shards of another dataset "
                                 "(mappings '")


def test_a_shard_set_whose_samples_are_out_of_order_stops_at_the_first_misplaced_sample(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    folder, index = small_chunks(tmp_path_factory, tmp_path / "shards")
    listing = json.loads((folder / "index.json").read_text())
    listing["chunks"][0], listing["chunks"][1] = listing["chunks"][1], listing["chunks"][0]
    (folder / "index.json").write_text(json.dumps(listing))
    images = ShardImages(str(folder), "", "1GB", {"recipe": TIMM}, "make prep-timm_imagenet FORMAT=shards")
    with pytest.raises(UserError, match=r"\[0\] \(.*\) holds entry \d+ of its list: the shard set is damaged; write "
                                        r"it again with `make prep-timm_imagenet FORMAT=shards`"):
        images[0]


@pytest.mark.slow
def test_sigkill_mid_epoch_on_shards_through_a_cache_resumes_to_the_model_of_an_uninterrupted_run_on_files(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The resume chain of tests/resume.py, reading shards through a file:// remote and its cache
    with a DataLoader worker and a policy; the reference read the loose files."""
    trained_runs.imagenet_shards(tmp_path_factory)
    settings = [*tiny_settings(TIMM, tmp_path_factory), "trainer.epochs=2", "trainer.batch_size=4",
                "trainer.num_workers=1", "data.auto_augment=rand-m9-mstd0.5-inc1", "seed=3"]
    reference = tmp_path / "files"
    assert_ok(run_recipe(TIMM, [*settings, *CHAIN_SETTINGS, f"run_dir={reference}"]))
    root = Path(next(o for o in settings if o.startswith("data.root=")).split("=", 1)[1])
    shards = ["data.format=shards", f"data.shards.root={remote(root / 'shards')}",
              f"data.shards.cache_dir={tmp_path / 'cache'}"]
    summary = kill_signal_resume(TIMM, [*settings, *shards], tmp_path, 1, signal.SIGTERM, reference=reference)
    assert summary["model_digest"] == read_summary(reference)["model_digest"]


def test_the_launchers_preflight_checks_the_shards_folder_or_leaves_a_remote_to_the_run(tmp_path: Path) -> None:
    from cluster.preflight import CheckFailed, check_data

    (tmp_path / "shards").mkdir()
    assert check_data(TIMM, [f"data.root={tmp_path}", "data.format=shards"]) == str(tmp_path / "shards")
    assert check_data(TIMM, ["data.root=/nowhere", "data.format=shards", "data.shards.root=s3://bucket/x"]) == \
        "shards at s3://bucket/x (a remote: the run reads its index.json at start)"
    with pytest.raises(CheckFailed, match=r"^/nowhere/shards does not exist \(make prep-timm_imagenet FORMAT=shards"):
        check_data(TIMM, ["data.root=/nowhere", "data.format=shards"])
