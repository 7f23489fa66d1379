"""``make gpu-check``: what only a GPU can show, in one command, one process at a time.

    python3 -m benchmarks.gpu_check --quick        # on a GPU machine: the checks without the figures, minutes
    python3 -m benchmarks.gpu_check                # the checks and the figures (no make setup needed)
    python -m benchmarks.gpu_check --device cpu    # the same sequence at tiny sizes (make gpu-check DEVICE=cpu)

It first checks that this Python has every package it needs (one line naming the missing ones).

Checks (each passes or fails; any failure makes the exit code 1):

* every recipe through its real ``train.py`` on tiny data written here in the dataset's own
  format, a few dozen steps in bf16 (channels_last where the recipe uses it), with background
  checkpoints (pinned host buffers on a GPU) and ``trainer.deterministic=true``: an
  uninterrupted run; a run sent SIGTERM after its first checkpoint, which must exit with 75;
  its resume, whose ``model_digest`` must equal the uninterrupted run's. Without ``--quick``, a
  short run with ``trainer.compile=true`` where compiling is what differs: cifar100_resnet50
  (the line ``compile_static(ddp_model)`` the other four DDP recipes share) and dinov2_fsdp
  (each block compiled inside FSDP2). dinov2_fsdp runs with FSDP2 on one rank (``fsdp.on_one_rank``, nccl
  on a GPU) across the probe-to-fine-tune switch, so its checkpoints are sharded saves and loads;
  on CUDA also a short run with CPU offload and gradient clipping (``cpu:gloo,cuda:nccl``).
* on CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` in each uninterrupted run: every host
  sync is traced to its line in ``train.py``; any inside the training step, other than the
  logging and checkpoint branches, fails the check;
* on CUDA, ``data.decode=gpu`` (nvjpeg, then the crop on the device) gives the images the
  CPU path gives, for every kind of file an ImageNet folder holds, and nvjpeg decoding while a
  long matrix product whose operands were just freed is queued on the stream corrupts neither
  (pytorch/vision#9606);
* tv_segmentation's synchronised BatchNorm (``AllReduceBatchNorm``) across two processes (gloo:
  NCCL refuses two ranks on one GPU) equals BatchNorm over the whole batch; on CUDA its forward
  and backward over NCCL make no host sync.

Figures (not with ``--quick``; reported with their goal, a figure short of its goal is not a
failed check), each model built once: ResNet-50 224 px training images/s (bf16, channels_last,
eager, eager with ``trainer.deterministic`` (its cost), then compiled; synthetic batch on the
device), ViT-B/14 and ViT-L/14 fine-tune images/s and MFU (eager; ViT-L/14, the MFU goal's
model, compiled too), the checkpoint stall of a background save into pinned buffers against a
synchronous one, the fashion_mnist loop's overhead against a bare loop, and peak GPU memory of
each; with the checks, the host time of a ``data.decode=gpu`` decode call with work queued.

On CUDA the results go into a dated section at the end of ``benchmarks/RESULTS.md``'s
hand-written part and into ``benchmarks/gpu_check.json``; ``--results`` and ``--json`` choose
other files (on the CPU nothing is recorded unless they are given). The whole check must fit in
``--budget-seconds`` (9 minutes on one H100, 5 with ``--quick``); running over is a failed check.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import datetime as dt
import json
import os
import platform
import runpy
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.gpu_check_packages import exit_if_missing

exit_if_missing()  # before torch and this project's modules are imported: one line naming what is missing

import torch  # noqa: E402

from benchmarks.results import Result  # noqa: E402
from benchmarks.run import HAND_END, RESULTS_FILE, format_value  # noqa: E402
from common.errors import EXIT_PREEMPTED  # noqa: E402
from common.pytorch.determinism import CUBLAS_WORKSPACE  # noqa: E402
from common.run_lock import LOCK_FILE  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
JSON_FILE = Path(__file__).with_name("gpu_check.json")
WORK_DIR = REPO / "runs" / "gpu_check"
BUDGET_S = 540
QUICK_BUDGET_S = 300
RECIPES = ("fashion_mnist", "cifar100_resnet50", "timm_imagenet", "tv_segmentation", "fungitastic", "dinov2_fsdp")
COMPILED = ("cifar100_resnet50", "dinov2_fsdp")  # the two ways the recipes compile (compile_static: see above)
SYNC_WARNING = "called a synchronizing CUDA operation"
OUTSIDE_TRAIN_PY = "outside train.py"
# nvjpeg's images against OpenCV's (libjpeg-turbo) decode: mean absolute difference, in grey levels.
# Their IDCT and chroma upsampling differ; on the noisy synthetic photos here by up to about 2.1
# levels on average (H200, torch 2.11). Corruption is judged against nvjpeg's own images instead.
NVJPEG_VS_CPU = 4
SITE_ORIGIN = " at "  # in a sync site: the train.py lines, then the file and line that synced
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


@dataclass
class Check:
    name: str
    passed: bool
    seconds: float
    detail: str


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    figures: list[Result] = field(default_factory=list)

    def timed(self, name: str, action: Callable[[], str]) -> bool:
        """Run ``action`` (it returns a one-line detail, or raises on failure) as a check."""
        start = time.perf_counter()
        try:
            detail, passed = action(), True
        except Exception as error:  # a failed check is reported, the others still run
            detail, passed = f"{type(error).__name__}: {error}".splitlines()[0], False
            traceback.print_exc()
        self.checks.append(Check(name, passed, time.perf_counter() - start, detail))
        print(f"[{'pass' if passed else 'FAIL'}] {name}: {detail}", flush=True)
        return passed


class CheckFailed(Exception):
    """A check's expectation that did not hold."""


# ---- tiny data, in each dataset's own format -----------------------------------------------------------


def write_datasets(root: Path) -> dict[str, list[str]]:
    """Every recipe's tiny data under ``root``; returns each recipe's data and model overrides. The
    per-sample policies run on the device (cifar100's TrivialAugment; timm_imagenet's and
    fungitastic's after nvjpeg, ``data.decode=gpu``), so that the host-sync check covers them."""
    from data_prep import fungitastic as fungi_prep
    from tools import tiny_data

    cifar = root / "cifar100"
    with tarfile.open(tiny_data.write_cifar100_tarball(root / "cifar-100-python.tar.gz", n_train=128, n_test=16)) \
            as archive:
        archive.extractall(cifar, filter="data")
    fungi = root / "fungitastic"
    tiny_data.write_fungitastic(root / "fungitastic-download")
    fungi_prep.prepare(fungi, root / "fungitastic-download", "300p", mini=True, per_species=2, skip_missing=False)
    dinov2 = write_tiny_dinov2(root / "dinov2_tiny")
    return {
        "fashion_mnist": [f"data.root={tiny_data.write_fashion_mnist(root / 'fashion_mnist')}",
                          "model.channels=[4,8]", "model.hidden=16", "trainer.batch_size=16",
                          "trainer.channels_last=true"],
        "cifar100_resnet50": [f"data.root={cifar}", "model.name=test_resnet", "trainer.batch_size=8",
                              "trainer.channels_last=true", "data.auto_augment=trivialaugment"],
        "timm_imagenet": [f"data.root={tiny_data.write_image_folder(root / 'imagenet', train_per_class=16)}",
                          "model.name=test_resnet", "data.train_size=32", "data.eval_size=32",
                          "trainer.batch_size=8", "trainer.num_workers=0", "trainer.channels_last=true",
                          "data.decode=gpu", "data.auto_augment=ta_wide"],
        "tv_segmentation": [f"data.root={tiny_data.write_voc(root / 'VOC2012', n_train=12, n_val=4)}",
                            "model.name=deeplabv3_mobilenet_v3_large", "data.base_size=40", "data.crop_size=40",
                            "trainer.batch_size=2", "trainer.num_workers=0", "trainer.channels_last=true"],
        "fungitastic": [f"data.root={fungi}", "model.name=test_vit", "model.pretrained=", "data.image_size=32",
                        "trainer.batch_size=4", "trainer.num_workers=0", "data.decode=gpu"],
        "dinov2_fsdp": [f"data.root={cifar}", f"model.weights={dinov2}", "model.image_size=28", "trainer.batch_size=8",
                        "trainer.global_batch_size=8", "stages.probe_epochs=1", "fsdp.on_one_rank=true"],
    }


def write_tiny_dinov2(path: Path) -> Path:
    """A 'pretrained' two-block DINOv2 in transformers' save_pretrained layout, with a position
    table for 56 px while the run trains at 28 (as the published weights are for 518 px and the
    recipe trains at 224): a table interpolated in each forward fails the deterministic backward."""
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, image_size=56,
                          patch_size=14)
    Dinov2Model(config).save_pretrained(path)
    return path


# ---- running a recipe ------------------------------------------------------------------------------------


def recipe_env(device: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if key not in ("CHECKPOINT_ARTIFACT_PATH", "LOSSY_ARTIFACT_PATH", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                          "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, [
        str(REPO), os.environ.get("PYTHONPATH")])))
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # recipes run side by side on few cores
    return env


def recipe_command(recipe: str, overrides: list[str], syncs_file: Path | None) -> list[str]:
    """``python -m recipes.<r>.train``, or the same through :func:`trace_syncs`."""
    if syncs_file is None:
        return [sys.executable, "-m", f"recipes.{recipe}.train", *overrides]
    return [sys.executable, "-m", "benchmarks.gpu_check", "--trace-syncs", str(syncs_file), "--recipe", recipe,
            "--", *overrides]


def run_timeout(device: str) -> float:
    """Seconds after which a recipe run counts as hung (compiling on a busy 2-core CPU takes many minutes)."""
    return 600 if device == "cuda" else 1800


def run_to_end(recipe: str, overrides: list[str], device: str, log: Path,
               syncs_file: Path | None = None) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(recipe_command(recipe, overrides, syncs_file), cwd=REPO, env=recipe_env(device),
                                capture_output=True, text=True, timeout=run_timeout(device))
    except subprocess.TimeoutExpired as error:
        log.write_text("".join(part.decode(errors="replace") if isinstance(part, bytes) else part
                               for part in (error.stdout or "", error.stderr or "")))
        raise CheckFailed(f"the run did not end within {error.timeout:.0f} s (see {log})") from error
    log.write_text(result.stdout + result.stderr)
    return result


def expect_exit(result: subprocess.CompletedProcess | subprocess.Popen, code: int, what: str, log: Path) -> None:
    if result.returncode != code:
        tail = log.read_text().strip().splitlines()[-1:] if log.is_file() else []
        raise CheckFailed(f"{what} exited with {result.returncode}, expected {code} (see {log}): {' '.join(tail)}")


def sigterm_after_first_checkpoint(recipe: str, overrides: list[str], device: str, checkpoints: Path,
                                   log: Path) -> int:
    """Start a run, send SIGTERM once its first checkpoint has begun, return its exit code."""
    with open(log, "w") as output:
        process = subprocess.Popen(recipe_command(recipe, overrides, None), cwd=REPO, env=recipe_env(device),
                                   stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + run_timeout(device)
        while process.poll() is None and time.monotonic() < deadline:
            # Any entry but the run's lock (taken before the run starts): the first save has begun.
            if checkpoints.is_dir() and any(path.name != LOCK_FILE for path in checkpoints.iterdir()):
                process.send_signal(signal.SIGTERM)
                break
            time.sleep(0.05)
        return process.wait(timeout=run_timeout(device))


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def check_recipe(report: Report, recipe: str, overrides: list[str], device: str, work: Path,
                 compile_too: bool) -> None:
    """Uninterrupted, SIGTERM'd and resumed runs (same digest), host syncs, a compiled run."""
    work.mkdir(parents=True)
    settings = [*overrides, f"device={device}", "trainer.precision=bf16", "trainer.deterministic=true",
                f"trainer.epochs={3 if device == 'cuda' else 2}", "trainer.log_every_steps=5",
                "checkpoint.every_steps=4", "checkpoint.every_seconds=0", "checkpoint.async_save=true",
                "logging.backend=none", "logging.progress_bar=false"]
    syncs_file = work / "syncs.json"  # traced on CUDA only; on the CPU the same launcher runs, tracing nothing
    reference, interrupted = work / "uninterrupted", work / "interrupted"

    def uninterrupted() -> str:
        result = run_to_end(recipe, [*settings, f"run_dir={reference}"], device, work / "uninterrupted.log",
                            syncs_file)
        expect_exit(result, 0, "the uninterrupted run", work / "uninterrupted.log")
        if not syncs_file.is_file():  # the tracer writes it from an atexit handler, however the run ends
            raise CheckFailed("the sync tracer wrote nothing at the run's exit")
        done = summary(reference)
        shown = f"{done['steps']} steps, {done['wall_time_s']:.1f} s, digest {done['model_digest'][:12]}"
        if recipe == "dinov2_fsdp":
            for expected in ("with FSDP2", "stage finetune: backbone unfrozen"):
                if expected not in result.stdout:
                    raise CheckFailed(f"the run's output lacks {expected!r}")
            shown += ", FSDP2 across the probe-to-fine-tune switch"
        return shown

    def sigterm_and_resume() -> str:
        log = work / "interrupted.log"
        code = sigterm_after_first_checkpoint(recipe, [*settings, f"run_dir={interrupted}"], device,
                                              interrupted / "checkpoints", log)
        if code != EXIT_PREEMPTED:
            tail = " ".join(log.read_text().strip().splitlines()[-1:])
            raise CheckFailed(f"after SIGTERM the run exited with {code}, expected {EXIT_PREEMPTED} "
                              f"(see {log}): {tail}")
        saved = [line for line in log.read_text().splitlines() if "checkpoint saved at step" in line]
        stopped = saved[0].split("checkpoint saved at step ")[1].split(";")[0] if saved else "?"
        resumed = run_to_end(recipe, [*settings, f"run_dir={interrupted}"], device, work / "resumed.log")
        expect_exit(resumed, 0, "the resumed run", work / "resumed.log")
        if "resumed from" not in resumed.stdout:
            raise CheckFailed("the second run did not resume from the SIGTERM checkpoint")
        got, expected = summary(interrupted)["model_digest"], summary(reference)["model_digest"]
        if got != expected:
            raise CheckFailed(f"resumed digest {got[:12]} != uninterrupted {expected[:12]}")
        return f"stopped at step {stopped} with exit {EXIT_PREEMPTED}; the resumed run's digest is the same"

    ran = report.timed(f"{recipe}: uninterrupted run", uninterrupted)
    report.timed(f"{recipe}: SIGTERM, exit {EXIT_PREEMPTED}, resume, same digest", sigterm_and_resume)
    if device == "cuda" and ran:
        report.timed(f"{recipe}: no host sync inside the step", lambda: judge_syncs(syncs_file))
    def short_run(name: str, *extra: str) -> str:
        run_dir, log = work / name, work / f"{name}.log"
        result = run_to_end(recipe, [*overrides, f"device={device}", "trainer.precision=bf16", "trainer.max_steps=6",
                                     "logging.backend=none", "logging.progress_bar=false", f"run_dir={run_dir}",
                                     *extra], device, log)
        expect_exit(result, 0, f"the {name} run", log)
        done = summary(run_dir)
        return f"{done['steps']} steps in {done['wall_time_s']:.1f} s"

    if compile_too:  # only the recipes of COMPILED are asked to
        report.timed(f"{recipe}: torch.compile", lambda: short_run("compiled", "trainer.compile=true")
                     + " (compilation included)")
    if recipe == "dinov2_fsdp" and device == "cuda":  # clipping reduces CPU-offloaded gradients over gloo
        report.timed(f"{recipe}: FSDP2 CPU offload with gradient clipping",
                     lambda: short_run("offloaded", "fsdp.cpu_offload=true", "trainer.grad_clip_norm=1.0",
                                       "stages.probe_epochs=0"))


# ---- host syncs inside the step ---------------------------------------------------------------------------


def step_lines(train_py: Path) -> tuple[set[int], set[int]]:
    """Lines of the training step in ``train_py`` (the loop over ``run.steps(...)`` whose body calls
    ``run.step_done``) and, within it, those allowed to sync: the logging branch, and the loop's
    own line, where the run contract saves between steps (``common/run/training_run.py``)."""
    tree = ast.parse(train_py.read_text())
    step: set[int] = set()
    allowed: set[int] = set()
    for loop in ast.walk(tree):
        if not (isinstance(loop, ast.For) and any(
                isinstance(node, ast.Call) and ast.unparse(node.func) == "run.step_done" for node in ast.walk(loop))):
            continue
        step |= set(range(loop.lineno, loop.end_lineno + 1))
        allowed |= set(range(loop.iter.lineno, loop.iter.end_lineno + 1))
        for branch in ast.walk(loop):
            if isinstance(branch, ast.If) and "log_every_steps" in ast.unparse(branch.test):
                allowed |= set(range(branch.lineno, branch.end_lineno + 1))
    return step, allowed


def sync_site(stack: traceback.StackSummary | list[traceback.FrameSummary], train_py: str) -> str:
    """Where a sync comes from in ``train_py``: the line of each of its frames on the stack,
    innermost first (``"212,87"``: line 212 of a helper, called from line 87), or
    ``"outside train.py"``; then, where the innermost frame outside torch, ``warnings`` and this
    tracer is in another file, ``" at <file>:<line>"`` (the call that synced, e.g. in ``common/`` or torchvision)."""
    lines = [str(frame.lineno) for frame in reversed(stack) if frame.filename == train_py]
    site = ",".join(lines) or OUTSIDE_TRAIN_PY
    origin = next((frame for frame in reversed(stack) if not frame.filename.startswith(TORCH_DIR)
                   and frame.filename not in (__file__, warnings.__file__)), None)
    if origin is None or origin.filename == train_py:
        return site
    return f"{site}{SITE_ORIGIN}{_short_path(origin.filename)}:{origin.lineno}"


def _short_path(filename: str) -> str:
    """A path beside torch (site-packages, which may be inside the repository: ``.venv``) or inside
    this repository without its folders above."""
    for root in (os.path.dirname(TORCH_DIR.rstrip(os.sep)) + os.sep, str(REPO) + os.sep):
        if filename.startswith(root):
            return filename[len(root):]
    return filename


def step_line(site: str, step: set[int]) -> int | None:
    """The frame that puts a sync inside the step: walking outward from the innermost train.py
    frame, the first whose line is in ``step`` (a helper defined in train.py and called from the
    step counts as the step); None when no frame is."""
    lines = site.partition(SITE_ORIGIN)[0]
    if lines == OUTSIDE_TRAIN_PY:
        return None
    return next((line for line in map(int, lines.split(",")) if line in step), None)


def trace_syncs(recipe: str, syncs_file: Path, overrides: list[str]) -> None:
    """Run a recipe as ``python -m recipes.<r>.train`` would, with CUDA's sync debug mode on from
    the moment the process has its GPU, recording where each sync comes from in ``train.py``."""
    import common.pytorch.distributed

    train_py = str(REPO / "recipes" / recipe / "train.py")
    sites: Counter[str] = Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        if SYNC_WARNING not in str(message):
            return show_warning(message, category, filename, lineno, file, line)
        sites[sync_site(traceback.extract_stack(), train_py)] += 1
        return None

    show_warning = warnings.showwarning
    warnings.showwarning = record
    warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
    start_distributed = common.pytorch.distributed.init_distributed

    def init_then_trace(*args, **kwargs) -> common.pytorch.distributed.DistInfo:  # noqa: ANN002, ANN003
        info = start_distributed(*args, **kwargs)
        if info.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        return info

    common.pytorch.distributed.init_distributed = init_then_trace
    atexit.register(lambda: syncs_file.write_text(json.dumps(dict(sites))))
    sys.argv = [f"recipes.{recipe}.train", *overrides]
    runpy.run_module(f"recipes.{recipe}.train", run_name="__main__", alter_sys=True)


def judge_syncs(syncs_file: Path) -> str:
    """Fail on a sync whose stack passes through the step outside its logging and checkpoint lines."""
    recipe = syncs_file.parent.name
    step, allowed = step_lines(REPO / "recipes" / recipe / "train.py")
    in_step: Counter[str] = Counter()
    logging = elsewhere = 0
    for site, count in json.loads(syncs_file.read_text()).items():
        line = step_line(site, step)
        if line is None:
            elsewhere += count
        elif line in allowed:
            logging += count
        else:
            lines, _, origin = site.partition(SITE_ORIGIN)
            innermost = lines.split(",")[0]
            within = [f"in train.py:{innermost}"] if innermost != str(line) else []
            within += [f"at {origin}"] if origin else []
            in_step[f"train.py:{line}" + (f" ({', '.join(within)})" if within else "")] += count
    if in_step:
        where = ", ".join(f"{site} x{count}" for site, count in sorted(in_step.items()))
        raise CheckFailed(f"host syncs inside the step at {where}")
    return f"none in the step; {logging} in logging/checkpoint branches, {elsewhere} outside the step"


# ---- SyncBatchNorm ----------------------------------------------------------------------------------------


def _sync_batchnorm_worker(rank: int, port: int, device_type: str, out: Path) -> None:
    import torch.distributed as dist

    from common.pytorch.distributed import shutdown_distributed
    from recipes.tv_segmentation.sync_batchnorm import convert_sync_batchnorm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        device = torch.device(device_type)
        torch.manual_seed(0)
        batch, weights = torch.randn(2, 8, 4, 5, 5, device=device)
        model, converted = convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(4)))
        model = model.to(device)
        half = batch[rank * 4:(rank + 1) * 4].clone().requires_grad_()
        (model(half) * weights[rank * 4:(rank + 1) * 4]).square().sum().backward()
        torch.save({"kind": type(model[0]).__name__, "converted": converted, "grad": half.grad.cpu(),
                    "running_mean": model[0].running_mean.cpu()}, out / f"rank{rank}.pt")
    finally:
        shutdown_distributed()  # the group freed before the interpreter's shutdown (see its docstring)


def check_sync_batchnorm(device: str, work: Path) -> str:
    """Two ranks with half a batch each give the gradients BatchNorm gives over the whole batch."""
    import torch.multiprocessing as mp

    from common.pytorch.distributed import free_port

    work.mkdir(parents=True)
    mp.spawn(_sync_batchnorm_worker, args=(free_port(), device, work), nprocs=2, join=True)
    torch.manual_seed(0)
    batch, weights = torch.randn(2, 8, 4, 5, 5, device=device).cpu()
    batch.requires_grad_()
    reference = torch.nn.BatchNorm2d(4)
    # Weights per element: with one per channel, the normalised outputs' squares would sum to a
    # constant and every gradient would be rounding noise (about 1e-3), which no tolerance judges.
    (reference(batch) * weights).square().sum().backward()
    ranks = [torch.load(work / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    grad = torch.cat([saved["grad"] for saved in ranks])
    if not torch.allclose(grad, batch.grad, rtol=1e-4, atol=1e-5):
        raise CheckFailed(f"gradients differ from BatchNorm over the whole batch by {(grad - batch.grad).abs().max()}")
    if not torch.allclose(ranks[0]["running_mean"], reference.running_mean, atol=1e-6):
        raise CheckFailed("running statistics differ from BatchNorm over the whole batch")
    return f"{ranks[0]['kind']} on {device}: gradients and running statistics equal BatchNorm's over the whole batch"


def _batchnorm_syncs_worker(rank: int, port: int) -> None:
    from unittest import mock

    import torch.distributed as dist

    from common.pytorch.distributed import shutdown_distributed
    from recipes.tv_segmentation.sync_batchnorm import convert_sync_batchnorm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        layers = [torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3),
                  torch.nn.BatchNorm2d(8)]
        model = convert_sync_batchnorm(torch.nn.Sequential(*layers))[0].cuda()
        images = torch.randn(4, 3, 16, 16, device="cuda")
        # A group of one takes plain BatchNorm's path: make it take the synchronised one.
        with mock.patch.object(dist, "get_world_size", return_value=2):
            model(images).square().mean().backward()  # NCCL sets its communicator up here
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                model(images).square().mean().backward()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        shutdown_distributed()


def check_batchnorm_syncs() -> str:
    """tv_segmentation's synchronised BatchNorm on CUDA (NCCL): forward and backward with CUDA's
    sync debug mode set to raise."""
    import torch.multiprocessing as mp

    from common.pytorch.distributed import free_port

    mp.spawn(_batchnorm_syncs_worker, args=(free_port(),), nprocs=1, join=True)
    return "AllReduceBatchNorm: forward and backward on NCCL without a host sync"


# ---- figures ------------------------------------------------------------------------------------------------


def check_nvjpeg(work: Path) -> str:
    """timm_imagenet's ``data.decode=gpu``: nvjpeg decodes (the worker decodes what nvjpeg cannot:
    greyscale, CMYK, a PNG named .JPEG) and crops as the CPU path does, to a few grey levels."""
    from common.config import Decode
    from common.data.device_input import DeviceTrainInput
    from common.data.images import PathImages, TrainAugmentation, TrainImages, collate_train
    from common.data.loaders import PerSampleSeeded
    from tools.tiny_data import write_jpeg_cases

    cases = write_jpeg_cases(work)
    names = ["rgb", "large", "greyscale", "cmyk", "png", "rgb"]
    augmentation = TrainAugmentation(size=48, colour_jitter=0.4)

    def pixels(decode: Decode, device: torch.device) -> torch.Tensor:
        files = PathImages([str(cases[n]) for n in names], [0] * len(names))
        images = PerSampleSeeded(TrainImages(files, augmentation, decode), seed=4)
        batch, _ = collate_train([(images[(0, i)][0], 0) for i in range(len(names))])
        return DeviceTrainInput(augmentation, decode, (0.0,) * 3, (1 / 255,) * 3, device)(batch).float().cpu()

    on_gpu, on_cpu = pixels(Decode.gpu, torch.device("cuda")), pixels(Decode.cpu, torch.device("cpu"))
    differences = {name: float((g - c).abs().mean()) for name, g, c in zip(names, on_gpu, on_cpu)}
    worst = max(differences, key=differences.get)
    if differences[worst] >= NVJPEG_VS_CPU:
        raise CheckFailed(f"{worst}: nvjpeg's crop differs from the CPU path's by {differences[worst]:.1f} grey levels")
    return f"{len(names)} images, largest mean difference {differences[worst]:.2f} grey levels ({worst})"


def check_decode_under_load(work: Path, figures: list[Result]) -> str:
    """``data.decode=gpu`` while the training stream is busy: nvjpeg decodes while a long matrix
    product whose operands were just freed is still queued, as in a training step
    (pytorch/vision#9606 saw 199 of 200 such decodes corrupt on an H100). The images must equal
    nvjpeg's on an idle GPU exactly (and the CPU decode to ``NVJPEG_VS_CPU``), and the product its value
    on an idle GPU. Also times a decode call on the host with that work queued: the side stream
    this project uses, and a sync before the decode (the other safe way)."""
    import statistics

    from common.config import Decode
    from common.data.device_input import DeviceTrainInput
    from common.data.images import TrainAugmentation, decode, read_file
    from tools.tiny_data import write_jpeg_cases

    cases = write_jpeg_cases(work, width=1000, height=750)  # "large" is 4000 x 3000, a phone photo
    files = [str(cases[name]) for name in ("rgb", "large")] * 4
    pieces = [torch.from_numpy(read_file(path)) for path in files]
    device = torch.device("cuda")
    to_model = DeviceTrainInput(TrainAugmentation(size=224), Decode.gpu, (0.0,) * 3, (1.0,) * 3, device)
    idle = [image.cpu() for image in to_model.decode_on_device(pieces)]
    worst = max(float((image.float() - torch.from_numpy(decode(read_file(path), path)).permute(2, 0, 1)).abs().mean())
                for image, path in zip(idle, files))
    if worst >= NVJPEG_VS_CPU:
        raise CheckFailed(f"nvjpeg's images differ from the CPU decode by {worst:.1f} grey levels on average")

    def queued_work(seed: int) -> torch.Tensor:
        """Tens of milliseconds of work on the stream; its operands are freed when this returns."""
        operand = torch.randn(8192, 8192, device=device, generator=torch.Generator(device).manual_seed(seed))
        return (operand @ operand).sum(0)

    expected = [queued_work(trial).cpu() for trial in range(20)]
    bad_images = bad_work = 0
    for trial in range(20):
        result = queued_work(trial)
        images = to_model.decode_on_device(pieces)
        bad_images += any(not torch.equal(image.cpu(), reference) for image, reference in zip(images, idle))
        bad_work += not torch.equal(result.cpu(), expected[trial])
    if bad_images or bad_work:
        raise CheckFailed(f"decoding while work was queued corrupted the images {bad_images} times and the queued "
                          f"work {bad_work} times in 20")

    def host_ms(decode_call: Callable[[], object]) -> float:
        times = []
        for trial in range(5):
            queued_work(trial)
            start = time.perf_counter()
            decode_call()
            times.append(1000 * (time.perf_counter() - start))
            torch.cuda.synchronize()
        return statistics.median(times)

    def sync_then_decode() -> object:
        torch.cuda.current_stream().synchronize()
        return to_model.decode_on_device(pieces)

    name, setting = "data.decode=gpu: host time of a decode call", "8 JPEGs (4 of 12 MP), 8192^3 matmul queued"
    figures += [Result(name, f"{setting}, side stream (used)", host_ms(lambda: to_model.decode_on_device(pieces)),
                       "ms", "the host does not wait for the queued work"),
                Result(name, f"{setting}, sync first", host_ms(sync_then_decode), "ms",
                       "the other safe way: the host waits for the queued work")]
    return f"20 decodes with work queued: images and work intact; nvjpeg vs CPU decode {worst:.2f} grey levels"


def check_copied_ahead() -> str:
    """``copied_ahead`` (the next batch's copy on a side stream while the step before trains): with a
    long product queued on the training stream after each batch is handed out, every batch arrives
    whole, in order, and the product is intact; the copy of batch i + 1 is queued before batch i is
    used, so the host never waits for the training stream."""
    from common.data.loaders import copied_ahead

    device = torch.device("cuda")
    batches = [torch.full((256, 3, 224, 224), i, dtype=torch.uint8).pin_memory() for i in range(12)]
    operand = torch.randn(8192, 8192, device=device)
    expected = (operand @ operand).sum(0).cpu()
    bad_batches = bad_work = 0
    for i, batch in enumerate(copied_ahead(iter(batches), lambda b: b.to(device, non_blocking=True), device)):
        result = (operand @ operand).sum(0)  # tens of milliseconds queued after the batch was handed out
        bad_batches += not bool((batch == i).all())
        bad_work += not torch.equal(result.cpu(), expected)
    if bad_batches or bad_work:
        raise CheckFailed(f"copies on the side stream corrupted {bad_batches} batches and the queued work "
                          f"{bad_work} times in {len(batches)}")
    return f"{len(batches)} batches of 38.5 MB copied ahead under a queued 8192^3 product: all intact"


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def resnet50_figures(device: torch.device, compile_too: bool) -> list[Result]:
    """One ResNet-50: eager, eager with trainer.deterministic (its cost), then compiled."""
    from benchmarks.cifar100_resnet50 import SyntheticSetting, imagenet_model, synthetic_images_per_second
    from common.pytorch.determinism import configure_determinism

    full = device.type == "cuda"
    name, size, batch, steps, warmup = ("resnet50", 224, 256, 30, 10) if full else ("test_resnet", 32, 8, 3, 1)
    model = imagenet_model(name, device)
    figures = []
    for compiled, deterministic in ((False, False), (False, True), (True, False)):
        if compiled and not compile_too:
            continue
        configure_determinism(deterministic, device.type)
        reset_peak(device)
        value = synthetic_images_per_second(model, size, batch, SyntheticSetting("bf16", True, compiled), steps,
                                            warmup, device)
        setting = (f"{name} {size}px batch {batch}, bf16, channels_last, {'compiled' if compiled else 'eager'}"
                   + (", trainer.deterministic" if deterministic else ""))
        goal = "" if deterministic else ">= 3,000 on one H100"
        figures += [Result("ResNet-50 training throughput", setting, value, "images/s", goal),
                    Result("ResNet-50 training throughput", setting, peak_gib(device), "GiB peak", "")]
    configure_determinism(False, device.type)
    return figures


def vit_figures(device: torch.device, compile_too: bool) -> list[Result]:
    """ViT-B/14 eager; ViT-L/14, the model of the MFU goal, eager then compiled (one model each)."""
    from benchmarks import dinov2_fsdp

    sizes = dinov2_fsdp.FULL if device.type == "cuda" else dinov2_fsdp.QUICK
    figures = []
    for size in sizes:
        compiled_too = compile_too and size is sizes[-1]
        for result in dinov2_fsdp.measure(size, device, compiled_too, warmup=5, steps=15):
            if result.unit == "% MFU" and "ViT-L" in result.setting:
                result.note += "; goal >= 40"
            figures.append(result)
    return figures


def checkpoint_stall_figures(device: torch.device, work: Path) -> list[Result]:
    import statistics

    from benchmarks import checkpoint_stall

    work.mkdir(parents=True)
    reset_peak(device)
    times = checkpoint_stall.measure(device, 5 if device.type == "cuda" else 2, work)
    sync, blocked = statistics.median(times["sync"]), statistics.median(times["async"])
    name = "checkpoint stall (ResNet-50 + SGD momentum)"
    return [Result(name, "synchronous CheckpointManager save", sync, "ms", "atomic write, fsync, sha256"),
            Result(name, "background save: loop blocked", blocked, "ms",
                   "copy into reused pinned host buffers" if device.type == "cuda" else "copy into host buffers"),
            Result(name, "background / synchronous", 100 * blocked / sync, "%", "goal <= 10"),
            Result(name, "peak memory", peak_gib(device), "GiB peak", "")]


def overhead_figures(device: torch.device, work: Path) -> list[Result]:
    import statistics

    from benchmarks import overhead

    reset_peak(device)
    times = overhead.measure(device.type, 10 if device.type == "cuda" else 2, 128 if device.type == "cuda" else 32,
                             work)
    recipe, bare = times["recipe wall"], times["bare wall"]
    name = "loop overhead (fashion_mnist)"
    return [Result(name, "recipe step", statistics.median(recipe), "ms/step", "wall clock"),
            Result(name, "bare PyTorch step", statistics.median(bare), "ms/step", "wall clock"),
            Result(name, "overhead", statistics.median([100 * (r / b - 1) for r, b in zip(recipe, bare)]), "%",
                   "median over interleaved segments; goal <= 3"),
            Result(name, "peak memory", peak_gib(device), "GiB peak", "")]


# ---- the report --------------------------------------------------------------------------------------------


def driver_version() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


def environment(device: str) -> dict[str, str]:
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "none (CPU run at tiny sizes)"
    return {"device": gpu, "driver": driver_version() if device == "cuda" else "n/a",
            "cuda": torch.version.cuda or "n/a", "torch": torch.__version__,
            "python": platform.python_version()}


def table(report: Report) -> str:
    lines = ["| check | result | seconds | detail |", "|---|---|---:|---|"]
    lines += [f"| {c.name} | {'pass' if c.passed else '**FAIL**'} | {c.seconds:.0f} | {c.detail} |"
              for c in report.checks]
    lines += ["", "| figure | setting | value | unit | note |", "|---|---|---:|---|---|"]
    lines += [f"| {f.benchmark} | {f.setting} | {format_value(f.value)} | {f.unit} | {f.note} |"
              for f in report.figures]
    return "\n".join(lines)


def record_section(results_md: Path, text: str) -> None:
    """Append ``text`` at the end of the hand-written part of ``results_md``."""
    content = results_md.read_text()
    if HAND_END not in content:
        raise CheckFailed(f"{results_md} has no hand-written part (marker {HAND_END!r})")
    before = content.split(HAND_END, 1)[0]
    gap = "" if before.endswith("\n\n") or not before else "\n"  # a heading, not a table's next row
    results_md.write_text(content.replace(HAND_END, gap + text.rstrip("\n") + "\n" + HAND_END, 1))


def measured(report: Report, figures: Callable[[], list[Result]]) -> str:
    results = figures()
    report.figures.extend(results)
    return ", ".join(f"{format_value(r.value)} {r.unit}" for r in results if r.unit != "GiB peak")


def run_everything(report: Report, device_name: str, work: Path, compile_too: bool, figures_too: bool,
                   recipes: tuple[str, ...] = RECIPES) -> None:
    """The checks of ``recipes``' runs and the others, then the figures (alone on the machine, after the
    recipe runs)."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    overrides: dict[str, list[str]] = {}

    def write_data() -> str:
        overrides.update(write_datasets(work / "data"))
        return f"data for {len(overrides)} recipes under {work / 'data'}"

    if report.timed("tiny datasets written in their real formats", write_data):
        with ThreadPoolExecutor(max_workers=3 if device_name == "cuda" else 2) as pool:
            for future in [pool.submit(check_recipe, report, recipe, overrides[recipe], device_name, work / recipe,
                                       compile_too and recipe in COMPILED) for recipe in recipes]:
                future.result()
    report.timed("tv_segmentation: synchronised BatchNorm across 2 processes",
                 lambda: check_sync_batchnorm(device_name, work / "sync_batchnorm"))
    if device_name == "cuda":
        report.timed("tv_segmentation: synchronised BatchNorm without a host sync", check_batchnorm_syncs)
        report.timed("timm_imagenet data.decode=gpu: nvjpeg crops as the CPU path does",
                     lambda: check_nvjpeg(work / "jpegs"))
        report.timed("data.decode=gpu: nvjpeg with work queued on the stream, images and work intact",
                     lambda: check_decode_under_load(work / "jpegs_under_load", report.figures))
        report.timed("the next batch copied on a side stream while the step before trains, intact",
                     check_copied_ahead)
    if not figures_too:
        return
    device = torch.device(device_name)
    for name, figures in (("ResNet-50 figures", lambda: resnet50_figures(device, compile_too)),
                          ("ViT-B/14 and ViT-L/14 figures", lambda: vit_figures(device, compile_too)),
                          ("checkpoint stall figures", lambda: checkpoint_stall_figures(device, work / "stall")),
                          ("loop overhead figures", lambda: overhead_figures(device, work / "overhead"))):
        report.timed(name, lambda figures=figures: measured(report, figures))


def recipe_list(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in RECIPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown recipe {', '.join(unknown) or '(none)'}: "
                                         f"choose from {', '.join(RECIPES)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--results", type=Path, help="RESULTS.md to record into (default on CUDA: %s)" % RESULTS_FILE)
    parser.add_argument("--json", type=Path, help=f"JSON file to write (default on CUDA: {JSON_FILE})")
    parser.add_argument("--quick", action="store_true",
                        help="the checks without the figures and without compiling: a first contact of a few minutes")
    parser.add_argument("--budget-seconds", type=float,
                        help=f"fail if the whole check takes longer (default on CUDA: {BUDGET_S}, one H100; "
                             f"{QUICK_BUDGET_S} with --quick)")
    parser.add_argument("--work-dir", type=Path, default=WORK_DIR,
                        help="data, run directories and logs of the recipe runs (emptied first; default: %(default)s)")
    parser.add_argument("--recipes", type=recipe_list, default=RECIPES, metavar="NAME,NAME",
                        help="the recipes whose runs are checked (default: all six)")
    parser.add_argument("--skip-compile", action="store_true",
                        help="leave out the compiled runs (on a CPU they take minutes of C++ compilation)")
    parser.add_argument("--trace-syncs", type=Path, help=argparse.SUPPRESS)  # internal: one recipe run
    parser.add_argument("--recipe", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trace_syncs is not None:
        trace_syncs(args.recipe, args.trace_syncs, args.overrides)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA GPU is visible; on a machine without one run `make gpu-check DEVICE=cpu`",
              file=sys.stderr)
        return 2
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # this process measures deterministic mode too
    results_md = args.results or (RESULTS_FILE if args.device == "cuda" else None)
    json_file = args.json or (JSON_FILE if args.device == "cuda" else None)
    started, date = time.perf_counter(), dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    env = environment(args.device)
    print(f"gpu-check on {env['device']}: torch {env['torch']}, CUDA {env['cuda']}, driver {env['driver']}",
          flush=True)
    report = Report()
    run_everything(report, args.device, args.work_dir, compile_too=not (args.skip_compile or args.quick),
                   figures_too=not args.quick, recipes=args.recipes)
    seconds = time.perf_counter() - started
    budget = args.budget_seconds or ((QUICK_BUDGET_S if args.quick else BUDGET_S) if args.device == "cuda" else None)
    if budget is not None:
        report.checks.append(Check(f"within the time budget of {budget:.0f} s", seconds <= budget, seconds,
                                   f"took {seconds:.0f} s"))
    failed = [check.name for check in report.checks if not check.passed]
    command = "python -m benchmarks.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:])
    text = table(report)
    print("\n" + text + "\n")
    if json_file is not None:
        json_file.write_text(json.dumps({"date": date, "command": command.strip(), "seconds": seconds, **env,
                                         "checks": [asdict(c) for c in report.checks],
                                         "figures": [asdict(f) for f in report.figures]}, indent=1) + "\n")
        print(f"wrote {json_file}")
    if results_md is not None:
        record_section(results_md, "\n".join([
            f"### `make gpu-check`, {date}: {env['device']}", "",
            f"`{command.strip()}` on {env['device']} (driver {env['driver']}, CUDA {env['cuda']}), torch "
            f"{env['torch']}, Python {env['python']}; took {seconds:.0f} s; "
            f"{len(report.checks) - len(failed)} checks passed, {len(failed)} failed.", "", text, ""]))
        print(f"recorded in {results_md}")
    print(f"{'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
