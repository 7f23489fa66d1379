"""The mutations ``tools/mutation_check.py`` applies: each one a bug that would hurt users, the
exact source text it replaces, and the smallest set of tests that must catch it.

The first ones are those issue 15's audit found the suite letting through (adapted to the
checkpoint layout of issue 14); the others were chosen where a bug would cost users most: lost or
repeated samples, a resume that silently differs, a checkpoint that cannot be loaded or is loaded
damaged, metrics that depend on the number of ranks, and exit codes a cluster acts on. Issue 28's
are the bugs a run compared only with itself cannot show (it starts, finishes and resumes
bit-exactly, but does not learn what its config says): a key that does nothing, accumulation that
weighs samples unequally, randomness that repeats, rules that do not reset.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    id: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    breaks: str  # what a user would see


CHAIN = "test_sigkill_mid_epoch_then_a_stop_signal_then_resume_is_bit_exact"
FASHION_TWO_RANK_CHAIN = f"tests/test_fashion_mnist.py::{CHAIN}[2-SIGUSR1-evaluating-every-2-steps]"
TIMM_TWO_RANK_CHAIN = f"tests/test_timm_imagenet.py::{CHAIN}[2-SIGUSR1]"
KEY = "tests/test_config_keys.py::test_changing_a_key_changes_what_it_should"
EQUIVALENCE = "tests/test_gradient_equivalence.py::"
ACCUMULATED = f"{EQUIVALENCE}test_two_accumulated_micro_batches_give_the_gradient_of_one_batch_twice_as_large"
SHORT_LAST_STEP = f"{EQUIVALENCE}test_a_short_last_step_weighs_each_of_its_samples_as_a_full_step_does"
TWO_RANKS = f"{EQUIVALENCE}test_two_ranks_give_the_gradient_of_one_rank_with_the_same_global_batch"
DRAWS = "tests/test_augmentation_draws.py::"
RULES = "tests/test_run_rules.py::"
DIVERGENCE = "tests/test_divergence.py::"
OOM = "tests/test_out_of_memory.py::"
EVAL_STEPS = "tests/test_eval_every_steps.py::"
EVAL_RESUMED = (f"{EVAL_STEPS}test_a_run_killed_and_stopped_between_evaluations_evaluates_at_the_same_steps_and_ends"
                f"_the_same")
EVAL_TIMM = (f"{EVAL_STEPS}test_timm_imagenet_evaluates_every_n_steps_across_an_epochs_end_and_trains_each_sample_once"
             f"_an_epoch")
REDONE = f"{OOM}test_a_step_that_runs_out_of_memory_is_redone_with_half_the_micro_batch_bit_for_bit"
TWO_RANKS_AGREE = f"{OOM}test_on_two_ranks_every_rank_agrees_on_the_halved_micro_batch"
CHECKPOINTED = ("tests/test_activation_checkpointing.py::"
                "test_checkpointed_blocks_give_the_gradients_and_state_of_the_plain_model")
SOURCES = "tests/test_data_sources.py::"
LAYERS = "tests/test_layers.py::"
COPY_TRAINS = ("tests/test_new_recipe.py::"
               "test_a_copy_prepares_its_data_as_its_original_does_and_the_tool_names_each_command_it_needs")
PROGRESSIVE = "tests/test_progressive.py::"
PROGRESSIVE_TIMM = (f"{PROGRESSIVE}test_timm_trains_each_epoch_at_its_size_evaluates_at_eval_size_and_a_resume_ends_"
                    "with_the_same_digest")
AVERAGE = "tests/test_average.py::"
KEEP_BEST_K = "tests/test_checkpoint.py::test_keep_best_k_keeps_the_k_best_each_force_when_it_ranked_among_them"
CHECKPOINT_KILLED = ("tests/test_checkpoint.py::"
                     "test_a_save_killed_at_any_point_leaves_a_loadable_latest_and_nothing_half_done")
SWEEP = "tests/test_dinov2_linear_sweep.py::"

PREDICT = "tests/test_predict.py::"
PREDICTED_SPLIT = f"{PREDICT}test_predicting_the_evaluation_split_gives_the_top1_make_eval_reports"
UNREADABLE = f"{PREDICT}test_unreadable_files_are_named_and_the_rest_predicted"

MUTATIONS: list[Mutation] = [
    # ---- found by the audit (issue 15) ----------------------------------------------------------
    Mutation(
        "extended-run-stays-finished", "common/run/training_run.py",
        "self.progress.finished = False  # a finished run restarted with more epochs or steps goes on", "pass",
        ("tests/test_fashion_mnist.py::test_a_finished_run_extended_on_another_number_of_ranks_continues",),
        "a finished run restarted with more epochs reports its old metrics and writes no final checkpoint",
    ),
    Mutation(
        "timm-augmentation-seeded-by-step-of-this-process", "recipes/timm_imagenet/train.py",
        "        for group in run.steps(train_loader, train_input.to_device):  # one optimizer step per group of"
        " micro-batches\n"
        "            with group:  # out of memory in here: trainer.out_of_memory=halve hands the step out again,"
        " halved\n"
        "                # timm's Mixup draws from NumPy's global generator and drop path from torch's: seeded per"
        " step.\n"
        "                with seeded_global_rng(cfg.seed, progress.step, dist_info.rank):",
        "        for steps_here, group in enumerate(run.steps(train_loader, train_input.to_device)):\n"
        "            with group:\n"
        "                with seeded_global_rng(cfg.seed, steps_here, dist_info.rank):",
        (TIMM_TWO_RANK_CHAIN,),
        "a run resumed mid-epoch draws other augmentations than the uninterrupted run",
    ),
    Mutation(
        "symlink-moved-before-the-rename", "common/checkpoint/writer.py",
        "    os.rename(tmp, final)\n    fsync_dir(directory)\n    point_latest_at(directory, final)\n",
        "    point_latest_at(directory, final)\n    os.rename(tmp, final)\n    fsync_dir(directory)\n",
        (f"{CHECKPOINT_KILLED}[committed-True]",),
        "a crash between the two leaves the latest_checkpoint symlink naming a directory that is not there",
    ),
    Mutation(
        "delete-in-place", "common/checkpoint/manager.py",
        "        os.rename(path, doomed)\n        shutil.rmtree(doomed, ignore_errors=True)",
        "        shutil.rmtree(path, ignore_errors=True)",
        (f"{CHECKPOINT_KILLED}[deleting-True]",),
        "a crash while pruning leaves a checkpoint directory with files missing, some never cleaned up",
    ),
    Mutation(  # since issue 17 the stop branch of every recipe is this one, in the run contract
        "stop-branch-deleted", "common/run/training_run.py",
        "                if decision.stop:", "                if False:",
        (f"tests/test_fungitastic.py::{CHAIN}", f"tests/test_dinov2_fsdp.py::{CHAIN}"),
        "SIGTERM/SIGUSR1 are ignored: the run is killed at the end of the grace period and loses its work",
    ),
    Mutation(
        "torchrun-exits-1-after-a-stop-signal", "cluster/torchrun.py",
        "if len(codes) == workers and set(codes) == {EXIT_PREEMPTED}:", "if False:",
        ("tests/test_cluster.py::test_torchrun_exits_75_when_the_workers_themselves_get_sigterm",),
        "make train-<r> NPROC=n exits 1, not 75, after a SIGTERM: a pre-empted run looks like a crash",
    ),
    Mutation(
        "torchrun-skips-the-override-check", "cluster/torchrun.py",
        "    if args.module:\n        check_overrides(args.training_script, args.training_script_args)\n", "",
        ("tests/test_cluster.py::test_make_train_with_nproc_reports_a_bad_override_in_one_line_before_starting_workers",),
        "a bad override under torchrun prints every rank's error and torchrun's traceback, exit 1",
    ),
    Mutation(
        "tv-segmentation-confusion-matrix-not-reduced", "recipes/tv_segmentation/metrics.py",
        "            dist.all_reduce(counts, op=dist.ReduceOp.SUM)", "            pass",
        (f"tests/test_tv_segmentation.py::{CHAIN}",),
        "mIoU on 2 ranks counts only rank 0's pixels",
    ),
    # ---- where a bug would hurt users most --------------------------------------------------------
    Mutation(
        "sampler-resumes-at-the-start-of-the-epoch", "common/data/sampler.py",
        '        self.set_epoch(state["epoch"], state["consumed"])', '        self.set_epoch(state["epoch"], 0)',
        (FASHION_TWO_RANK_CHAIN,),
        "a resumed run sees the first part of its epoch twice",
    ),
    Mutation(
        "sampler-position-ignores-the-other-ranks", "common/data/sampler.py",
        "self.consumed + samples_per_rank * self.world_size)", "self.consumed + samples_per_rank)",
        (FASHION_TWO_RANK_CHAIN,),
        "a multi-rank run resumed mid-epoch repeats samples",
    ),
    Mutation(
        "torch-rng-not-restored", "common/pytorch/rng.py",
        '    torch.set_rng_state(state["torch"].cpu())', "    torch.get_rng_state()",
        ("tests/test_run.py::test_a_resume_brings_back_every_part_of_the_training_state",
         f"tests/test_cifar100_resnet50.py::{CHAIN}"),
        "drop path and dropout draw other masks after a resume: the run differs from an uninterrupted one",
    ),
    Mutation(
        "every-rank-gets-rank-0s-rng", "common/run/state.py",
        "    set_rng_state(rngs[rank] if same_world else rngs[0])", "    set_rng_state(rngs[0])",
        ("tests/test_run.py::test_partial_metric_sums_and_random_streams_of_every_rank_survive_a_resume",),
        "after a multi-rank resume every rank continues rank 0's random streams instead of its own",
    ),
    Mutation(
        "grad-scaler-not-restored", "common/run/state.py",
        '        run.scaler.load_state_dict(state["scaler"])', "        pass",
        ("tests/test_run.py::test_a_resume_brings_back_every_part_of_the_training_state",),
        "an fp16 run resumes with the initial loss scale: skipped steps or overflow after every resume",
    ),
    Mutation(
        "metric-sums-restored-from-rank-0", "common/run/state.py",
        "        run.train_sums.load_state_dict(saved_sums[rank])",
        "        run.train_sums.load_state_dict(saved_sums[0])",
        ("tests/test_run.py::test_partial_metric_sums_and_random_streams_of_every_rank_survive_a_resume",),
        "training metrics logged after a multi-rank resume count rank 0's partial sums twice",
    ),
    Mutation(
        "manifest-digests-not-checked", "common/checkpoint/layout.py",
        'if digests and file_digest(file) != expected["sha256"]:', "if False:",
        ("tests/test_checkpoint.py::test_a_damaged_latest_falls_back_to_the_previous_one[flip]",
         "tests/test_dinov2_fsdp.py::test_damaged_sharded_checkpoints_fall_back_to_the_newest_intact_one"),
        "a corrupted checkpoint is loaded instead of falling back to the previous one",
    ),
    Mutation(
        "prune-deletes-the-latest", "common/checkpoint/manager.py",
        "keep = {found_dir.path for found_dir in newest_first[: self.keep_last]}",
        "keep = {found_dir.path for found_dir in newest_first[1 : self.keep_last]}",
        ("tests/test_checkpoint.py::test_keep_last_n_steps_and_the_best_by_metric_which_is_force",),
        "the checkpoint just committed is deleted: the symlink names a deleted directory",
    ),
    Mutation(
        "uncommitted-directories-kept", "common/checkpoint/manager.py",
        "            if target is not None and found_dir.index > target.index and not found_dir.force:",
        "            if False:",
        ("tests/test_checkpoint.py::test_half_written_and_uncommitted_saves_are_ignored_and_removed",),
        "a save that never reached the symlink stays and is later taken for a committed checkpoint",
    ),
    Mutation(
        "dangling-symlink-taken-for-none", "common/checkpoint/layout.py",
        "        return Path(os.readlink(Path(directory) / LATEST)).name",
        "        target = Path(os.readlink(Path(directory) / LATEST))\n"
        "        return target.name if target.exists() else None",
        ("tests/test_atomic_directory.py::test_an_absolute_symlink_to_a_path_that_is_gone_resolves_by_name",),
        "checkpoints restored or downloaded to another path (every ISC cycle) resume from the wrong one",
    ),
    Mutation(
        "background-save-does-not-wait-for-the-previous", "common/checkpoint/manager.py",
        '        """\n        self.wait()\n        metrics = dict(metrics or {})',
        '        """\n        metrics = dict(metrics or {})',
        ("tests/test_checkpoint_async.py::test_one_save_in_flight_the_next_waits_for_it",),
        "two background writes at once: the host staging buffers are overwritten while being written",
    ),
    Mutation(
        "dinov2-stage-not-restored", "recipes/dinov2_fsdp/train.py",
        'stage = Stage(progress.extra.setdefault("stage", stage_of_epoch(0).value))',
        'progress.extra.setdefault("stage", stage_of_epoch(0).value)\n    stage = stage_of_epoch(0)',
        (f"tests/test_dinov2_fsdp.py::{CHAIN}",),
        "a run resumed in the fine-tune stage restarts the stage with a fresh optimizer",
    ),
    Mutation(
        "eval-metric-sums-not-reduced", "common/pytorch/metrics.py",
        "            dist.all_reduce(stacked, op=dist.ReduceOp.SUM)", "            pass",
        (FASHION_TWO_RANK_CHAIN,),
        "accuracy on several ranks is rank 0's share of the evaluation only",
    ),
    Mutation(
        "fungitastic-counts-not-reduced", "recipes/fungitastic/metrics.py",
        "            dist.all_reduce(flat, op=dist.ReduceOp.SUM)", "            pass",
        (f"tests/test_fungitastic.py::{CHAIN}",),
        "macro-F1 and top-k on several ranks count rank 0's samples only",
    ),
    Mutation(
        "eval-drops-the-last-samples", "recipes/timm_imagenet/spec.py",
        "sampler = ResumableDistributedSampler(len(images), dist_info.rank, dist_info.world_size, shuffle=False,\n"
        "                                          drop_last=False)",
        "sampler = ResumableDistributedSampler(len(images), dist_info.rank, dist_info.world_size, shuffle=False,\n"
        "                                          drop_last=True)",
        (TIMM_TWO_RANK_CHAIN,),
        "top-1 on 2 ranks leaves out the last val image of an odd count",
    ),
    Mutation(
        "evaluation-with-each-ranks-batchnorm", "common/after_training/evaluate.py",
        "    broadcast_buffers(model)\n", "",
        (f"tests/test_cifar100_resnet50.py::{CHAIN}",),
        "2-rank EMA metrics after a resume differ from an uninterrupted run's",
    ),
    Mutation(
        "worker-exit-code-not-recorded", "common/entry.py",
        "    record_exit_code(stop.exit_code)\n", "",
        (FASHION_TWO_RANK_CHAIN,),
        "under torchrun a pre-empted run exits 1: SLURM scripts and the ISC see a crash",
    ),
    Mutation(
        "user-error-traceback", "common/entry.py",
        "            raise SystemExit(report_stop(stop))",
        "            raise",
        ("tests/test_fashion_mnist.py::test_user_errors_are_one_line_and_exit_2",),
        "a missing data folder ends with a traceback instead of one line",
    ),
    Mutation(
        "tensorboard-logs-nothing", "common/records/loggers.py",
        "                self._writer.add_scalar(name, value, step)", "                pass",
        ("tests/test_loggers.py::test_tensorboard_writes_events",),
        "TensorBoard shows empty runs (the event file exists: SummaryWriter creates it at once)",
    ),
    Mutation(
        "loader-workers-die-of-a-group-sigterm", "common/data/loaders.py",
        "        worker_init_fn=leave_stop_signals_to_the_rank if num_workers > 0 else None,",
        "        worker_init_fn=None,",
        ("tests/test_loaders.py::test_a_worker_outlives_stop_signals_from_others_and_ends_when_its_rank_terminates_it",
         f"tests/test_fungitastic.py::{CHAIN}"),
        "SIGTERM through torchrun or SLURM kills the loader workers: the rank fails (exit 1), no stop checkpoint",
    ),
    # ---- issue 24: what the second read of the GPU paths found -----------------------------------
    Mutation(
        "stop-window-hard-coded-by-torch", "cluster/torchrun.py",
        "        close(self, death_sig, seconds)", "        close(self, death_sig, timeout)",
        ("tests/test_cluster.py::test_torchrun_gives_the_stop_checkpoint_its_window_where_torch_hard_codes_one",),
        "on torch 2.11 a stop checkpoint that takes over 30 s is killed mid-save, and the job exits 1, not 75",
    ),
    Mutation(
        "compiled-batch-dimension-made-dynamic", "common/run/steps.py",
        "    return torch.compile(model, dynamic=False)", "    return torch.compile(model)",
        ("tests/test_run.py::test_compiled_full_batches_keep_their_static_graph_after_the_epochs_short_batch",),
        "after an epoch's short last batch, every compiled step runs a slower dynamic-shape graph",
    ),
    Mutation(
        "tf32-through-the-new-api-only", "common/pytorch/determinism.py",
        "    torch.backends.cuda.matmul.allow_tf32 = fast_cuda",
        '    torch.backends.cuda.matmul.fp32_precision = "tf32" if fast_cuda else "ieee"',
        ("tests/test_determinism.py::test_both_tf32_apis_read_the_setting",),
        "Inductor's autotuning (any reader of allow_tf32) raises 'mix of the legacy and new APIs'",
    ),
    Mutation(
        "deterministic-flag-set-when-unchanged", "common/pytorch/determinism.py",
        "    if torch.are_deterministic_algorithms_enabled() != deterministic:\n",
        "    if True:\n",
        ("tests/test_determinism.py::test_a_flag_already_right_leaves_inductor_unimported",),
        "every run, a bad input's included, waits over a second for Inductor before its first step",
    ),
    Mutation(
        "position-table-interpolated-in-every-forward", "recipes/dinov2_fsdp/model.py",
        "        fit_position_table(backbone, cfg.image_size)", "        pass",
        ("tests/test_dinov2_fsdp.py::test_the_position_table_is_resampled_once_to_the_training_size",),
        "with trainer.deterministic=true on a GPU, the fine-tune stage fails at its first step",
    ),
    Mutation(
        "sync-judged-by-its-innermost-frame", "benchmarks/gpu_check.py",
        'map(int, lines.split(","))', 'map(int, lines.split(",")[:1])',
        ("tests/test_gpu_check.py::test_a_sync_in_a_helper_is_judged_by_the_frame_that_called_it_from_the_step",),
        "a host sync in a helper that the training step calls passes make gpu-check",
    ),
    # ---- what a run records (issue 26) -----------------------------------------------------------
    Mutation(
        "grad-norm-on-every-step", "common/run/training_run.py",
        "        if not self.trainer.grad_clip_norm and (self.progress.step + 1) % self.trainer.log_every_steps:\n"
        "            return None\n",
        "",
        ("tests/test_telemetry.py::test_grad_norm_is_logged_without_clipping_and_is_the_clipped_runs_norm_before_"
         "clipping",),
        "every step pays for a gradient norm only the logging steps use (on FSDP2, an all-reduce more per step)",
    ),
    Mutation(
        "data-wait-not-timed", "common/records/telemetry.py",
        "            self._data_wait += time.perf_counter() - start\n", "",
        ("tests/test_telemetry.py::test_data_wait_frac_rises_when_the_loader_is_slow",),
        "train/data_wait_frac says 0 while the GPU starves for data",
    ),
    Mutation(
        "checkpoints-without-provenance", "common/checkpoint/manager.py",
        "            manifest[\"provenance\"] = provenance\n", "            pass\n",
        ("tests/test_records.py::test_every_checkpoint_holds_the_record_of_the_segment_that_saved_it",),
        "a checkpoint folder shipped on its own no longer says which code and machine wrote it",
    ),
    # ---- issue 26: hangs that say where, compiled code that survives restarts ------------------------
    Mutation(
        "collective-timeout-is-a-traceback", "common/records/heartbeat.py",
        "            beat.hung(WAITED, error)", "            pass",
        ("tests/test_hangs.py::test_a_rank_stalled_in_a_step_is_named_with_its_host_phase_and_stacks",),
        "a hung run ends in a traceback (exit 1) that names neither the stalled rank nor its phase",
    ),
    Mutation(
        "compile-cache-not-restored", "common/run/training_run.py",
        "                self.console(self.compile_cache.restore(self.loaded))", "                pass",
        ("tests/test_compile_cache.py::test_a_resumed_compiled_run_does_not_compile_again",),
        "every requeued or cycled compiled run compiles again from scratch (minutes on a GPU)",
    ),
    # ---- issue 28: the run starts, finishes and resumes bit-exactly, but does not learn what the config says
    # a config key that silently does nothing, in each recipe and in the run contract
    Mutation(
        "fashion-mnist-horizontal-flip-ignored", "recipes/fashion_mnist/train.py",
        "cfg.data.horizontal_flip, generator, fill=BLACK)", "False, generator, fill=BLACK)",
        (f"{KEY}[fashion_mnist-data.horizontal_flip]",),
        "data.horizontal_flip=true trains on unflipped images",
    ),
    Mutation(
        "cifar100-rotation-ignored", "recipes/cifar100_resnet50/data.py",
        "        if cfg.rotation_degrees > 0:", "        if False:",
        (f"{KEY}[cifar100_resnet50-data.rotation_degrees]",),
        "data.rotation_degrees rotates nothing",
    ),
    Mutation(
        "timm-random-erasing-count-ignored", "recipes/timm_imagenet/data.py",
        "max_count=cfg.re_count", "max_count=1",
        (f"{KEY}[timm_imagenet-data.re_count]",),
        "data.re_count erases one rectangle per image whatever it says",
    ),
    Mutation(
        "tv-segmentation-flip-probability-ignored", "recipes/tv_segmentation/data.py",
        "A.HorizontalFlip(p=cfg.hflip_prob)", "A.HorizontalFlip(p=0.5)",
        (f"{KEY}[tv_segmentation-data.hflip_prob]",),
        "data.hflip_prob flips half of the images whatever it says",
    ),
    Mutation(
        "fungitastic-class-weights-ignored", "recipes/fungitastic/model.py",
        "weight=self.class_weights.get(level)", "weight=None",
        (f"{KEY}[fungitastic-loss.class_weighted_levels]",),
        "loss.class_weighted_levels leaves the loss unweighted: rare species count as little as before",
    ),
    Mutation(
        "dinov2-finetune-lr-ratio-ignored", "recipes/dinov2_fsdp/train.py",
        "lr, steps = probe_lrs[best] * cfg.stages.finetune_lr_ratio, plan.total - probe_steps",
        "lr, steps = probe_lrs[best], plan.total - probe_steps",
        (f"{KEY}[dinov2_fsdp-stages.finetune_lr_ratio]",),
        "the fine-tune stage trains the whole backbone at the probe's LR",
    ),
    Mutation(
        "keep-last-ignored", "common/run/training_run.py",
        "else checkpoint.keep_last,", "else 2,",
        (f"{KEY}[fashion_mnist-checkpoint.keep_last]",),
        "checkpoint.keep_last keeps 2 checkpoints whatever it says",
    ),
    # gradient accumulation: each micro-batch's loss weighted by its share of the step's samples
    Mutation(
        "fashion-mnist-micro-batches-weighted-alike", "recipes/fashion_mnist/train.py",
        "forward_backward(batch, generator, len(batch) / group.samples, i == len(group) - 1)",
        "forward_backward(batch, generator, 1 / len(group), i == len(group) - 1)",
        (f"{SHORT_LAST_STEP}[fashion_mnist]",),
        "an epoch's short last step over-weighs the samples of its short micro-batch",
    ),
    Mutation(
        "cifar100-accumulated-losses-summed", "recipes/cifar100_resnet50/train.py",
        "forward_backward(batch, generator, i, len(batch) / group.samples, i == len(group) - 1)",
        "forward_backward(batch, generator, i, 1.0, i == len(group) - 1)",
        (f"{ACCUMULATED}[cifar100_resnet50]",),
        "with accumulation the gradient is k times the global batch's: the LR is in effect k times larger",
    ),
    Mutation(
        "timm-accumulated-losses-summed", "recipes/timm_imagenet/train.py",
        "forward_backward(inputs, labels, len(labels) / group.samples, i == len(group) - 1)",
        "forward_backward(inputs, labels, 1.0, i == len(group) - 1)",
        (f"{ACCUMULATED}[timm_imagenet]",),
        "with accumulation the gradient is k times the global batch's: the LR is in effect k times larger",
    ),
    Mutation(
        "tv-segmentation-accumulated-losses-summed", "recipes/tv_segmentation/train.py",
        "forward_backward(images, masks, len(images) / group.samples, i == len(group) - 1)",
        "forward_backward(images, masks, 1.0, i == len(group) - 1)",
        (f"{ACCUMULATED}[tv_segmentation]",),
        "with accumulation the gradient is k times the global batch's: the LR is in effect k times larger",
    ),
    Mutation(
        "fungitastic-micro-batches-weighted-alike", "recipes/fungitastic/train.py",
        "forward_backward(inputs, labels, len(labels) / group.samples, i == len(group) - 1)",
        "forward_backward(inputs, labels, 1 / len(group), i == len(group) - 1)",
        (f"{SHORT_LAST_STEP}[fungitastic]",),
        "an epoch's short last step over-weighs the samples of its short micro-batch",
    ),
    Mutation(
        "dinov2-micro-batches-weighted-alike", "recipes/dinov2_fsdp/train.py",
        "forward_backward(batch, generator, len(batch) / group.samples, i == len(group) - 1)",
        "forward_backward(batch, generator, 1 / len(group), i == len(group) - 1)",
        (f"{SHORT_LAST_STEP}[dinov2_fsdp]",),
        "an epoch's short last step over-weighs the samples of its short micro-batch",
    ),
    Mutation(
        "short-step-counted-as-full", "common/run/steps.py",
        "samples = min(count * self.micro_batch, samples_left)", "samples = count * self.micro_batch",
        (f"{SHORT_LAST_STEP}[cifar100_resnet50]",),
        "an epoch's short last step is scaled as a full one: its gradient is too small",
    ),
    Mutation(
        "ranks-never-reduce-gradients", "common/pytorch/distributed.py",
        "    if sync or not isinstance(model, torch.nn.parallel.DistributedDataParallel):",
        "    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):",
        (f"{TWO_RANKS}[fashion_mnist]",),
        "under DDP every rank steps with its own gradient: the ranks' models drift apart",
    ),
    # the sampler's epoch seed
    Mutation(
        "sampler-order-ignores-the-epoch", "common/data/sampler.py",
        "generator.manual_seed(self.seed * 1_000_003 + epoch)", "generator.manual_seed(self.seed * 1_000_003)",
        (f"{DRAWS}test_the_sampler_orders_each_epoch_differently[fashion_mnist]",),
        "every epoch visits the samples in the first epoch's order",
    ),
    Mutation(
        "repeated-augmentation-order-ignores-the-epoch", "recipes/timm_imagenet/sampler.py",
        "generator.manual_seed(self.seed * 1_000_003 + epoch)", "generator.manual_seed(self.seed * 1_000_003)",
        (f"{DRAWS}test_timm_repeated_augmentation_orders_each_epoch_differently",),
        "with repeated augmentation every epoch uses the same third of the images, in the same order",
    ),
    Mutation(
        "epoch-not-handed-to-the-sampler", "common/run/training_run.py",
        "self.sampler.set_epoch(self.progress.epoch)", "self.sampler.set_epoch(0)",
        (f"{DRAWS}test_the_sampler_orders_each_epoch_differently[timm_imagenet]",),
        "every epoch repeats the first one's order and augmentation",
    ),
    # the augmentation's seed
    Mutation(
        "per-sample-augmentation-ignores-the-epoch", "common/data/loaders.py",
        "with seeded_global_rng(self.seed, epoch, index):", "with seeded_global_rng(self.seed, index):",
        (f"{DRAWS}test_a_sample_draws_differently_in_each_epoch[timm_imagenet]",),
        "each image gets the same crop, flip and policy every epoch: augmentation adds nothing after epoch 1",
    ),
    Mutation(
        "per-sample-augmentation-ignores-the-sample", "common/data/loaders.py",
        "with seeded_global_rng(self.seed, epoch, index):", "with seeded_global_rng(self.seed, epoch):",
        (f"{DRAWS}test_the_samples_of_a_batch_draw_differently[fungitastic]",),
        "every image of an epoch gets the same crop, flip and policy",
    ),
    Mutation(
        "fashion-mnist-augmentation-ignores-the-step", "recipes/fashion_mnist/train.py",
        "generator = seeded_generator(device, cfg.seed, progress.step, dist_info.rank)",
        "generator = seeded_generator(device, cfg.seed, 0, dist_info.rank)",
        (f"{DRAWS}test_each_step_draws_differently_from_the_one_before[fashion_mnist]",),
        "every step crops and flips its batch's rows alike",
    ),
    Mutation(
        "dinov2-augmentation-ignores-the-step", "recipes/dinov2_fsdp/train.py",
        "generator = seeded_generator(device, cfg.seed, progress.step, dist_info.rank)",
        "generator = seeded_generator(device, cfg.seed, 0, dist_info.rank)",
        (f"{DRAWS}test_each_step_draws_differently_from_the_one_before[dinov2_fsdp]",),
        "every step crops and flips its batch's rows alike",
    ),
    Mutation(
        "tv-segmentation-augmentation-seed-fixed", "recipes/tv_segmentation/data.py",
        "seed = random.getrandbits(64)", "seed = 0",
        (f"{DRAWS}test_the_samples_of_a_batch_draw_differently[tv_segmentation]",),
        "every image gets the same scale, flip and crop, every epoch",
    ),
    # rules with a reset, and the best
    Mutation(
        "early-stopping-count-never-restarts", "common/run/early_stopping.py",
        "progress.best_value, progress.evals_without_improvement = value, 0", "progress.best_value = value",
        (f"{RULES}test_the_patience_count_restarts_after_every_improvement",),
        "early stopping stops a run that is still improving, counting evaluations from before its last best",
    ),
    Mutation(
        "a-plateau-improves", "common/checkpoint/layout.py",
        'return best is None or (value > best if mode == "max" else value < best)',
        'return best is None or (value >= best if mode == "max" else value <= best)',
        (f"{RULES}test_early_stopping_waits_for_patience_evaluations_in_a_row_without_a_better_value",
         f"{RULES}test_every_new_best_is_force_and_the_summary_names_the_last_of_them[plateau]"),
        "a plateau never triggers early stopping, and every equal value is kept as a new best",
    ),
    Mutation(
        "best-mode-ignored", "common/checkpoint/layout.py",
        'return best is None or (value > best if mode == "max" else value < best)',
        "return best is None or value > best",
        (f"{RULES}test_every_new_best_is_force_and_the_summary_names_the_last_of_them[falling-min]",),
        "checkpoint.best_mode=min keeps the checkpoint with the highest loss",
    ),
    Mutation(
        "a-nan-metric-improves", "common/checkpoint/layout.py",
        "if value is None or not math.isfinite(value):", "if value is None:",
        (f"{RULES}test_a_nan_evaluation_never_improves_not_even_the_first",),
        "a run whose first evaluation is NaN never finds a better checkpoint and stops early",
    ),
    Mutation(
        "force-follows-only-the-first-value", "common/checkpoint/manager.py",
        "        self._best_value = value\n        return True",
        "        self._best_value = value if self._best_value is None else self._best_value\n        return True",
        (f"{RULES}test_every_new_best_is_force_and_the_summary_names_the_last_of_them[rising]",),
        "every checkpoint better than the first is _force: the ISC ships and keeps them all",
    ),
    Mutation(
        "best-checkpoint-is-the-last-finite-one", "common/checkpoint/layout.py",
        "            best, best_value = found_dir, value", "            best = found_dir",
        (f"{RULES}test_every_new_best_is_force_and_the_summary_names_the_last_of_them[rising]",),
        "summary.json, make eval WHICH=best and retention take the newest checkpoint with a metric for the best",
    ),
    # retention, and the evaluation cadence
    Mutation(
        "retention-drops-the-best", "common/checkpoint/manager.py",
        "            keep.add(best.path)", "            pass",
        (f"{RULES}test_retention_keeps_the_newest_steps_and_the_best_as_it_moves",),
        "the best checkpoint is deleted once keep_last newer ones exist",
    ),
    Mutation(
        "evaluation-every-epoch", "common/run/cadence.py",
        "return self.mid_epoch(step) if self.by_steps else epoch % self.every_epochs == 0",
        "return self.mid_epoch(step) if self.by_steps else True",
        (f"{RULES}test_evaluations_come_every_eval_every_epochs_and_at_the_end",),
        "trainer.eval_every_epochs is ignored: a long evaluation runs after every epoch",
    ),
    # ---- issue 34: after a rollback the loop goes on at the run's step ------------------------------
    Mutation(
        "restore-rebinds-the-progress", "common/run/state.py",
        '    run.progress.load_state_dict(state["progress"])',
        '    run._progress = type(run.progress)(**state["progress"])',
        (f"{DIVERGENCE}test_after_a_rollback_train_metrics_are_logged_every_log_every_steps[fashion_mnist]",
         f"{DIVERGENCE}test_after_a_rollback_each_step_draws_differently_from_the_one_before[cifar100_resnet50]",
         f"{DIVERGENCE}test_after_a_rollback_timm_imagenet_takes_the_scheduled_lr_of_each_step_times_the_factor",
         f"{DIVERGENCE}test_after_a_rollback_during_the_probe_dinov2_fsdp_switches_stage_when_the_probe_ends"),
        "after a rollback the loop reads a frozen step: no more train logs, the same augmentation every step, "
        "a constant LR, dinov2 never fine-tunes",
    ),
    Mutation(
        "no-checkpoint-of-a-fresh-optimizer", "common/run/training_run.py",
        '            self._save_before_next_step = self.divergence.rolls_back and self.logger is not None',
        "            pass",
        (f"{DIVERGENCE}test_a_rollback_in_dinov2_fsdps_fine_tune_goes_back_to_the_fine_tune",),
        "a rollback in dinov2's fine-tune loads the probe's checkpoint into the fine-tune's optimizer and crashes",
    ),
    Mutation(
        "rollback-lr-factor-misses-the-warmup", "common/run/divergence.py",
        '_SCHEDULE_LR_ATTRIBUTES = ("base_lrs", "base_values", "warmup_lr_init", "warmup_steps", "lr_min")',
        '_SCHEDULE_LR_ATTRIBUTES = ("base_lrs", "base_values")',
        (f"{DIVERGENCE}test_after_a_rollback_timm_imagenet_takes_the_scheduled_lr_of_each_step_times_the_factor",),
        "a timm run that rolls back in its warmup keeps the LR that diverged until the warmup ends",
    ),
    Mutation(
        "watch-reads-a-missing-loss", "common/run/training_run.py",
        "        if loss is None:\n            raise UserError(", "        if False:\n            raise UserError(",
        (f"{DIVERGENCE}test_a_loop_whose_loss_sum_has_another_name_stops_at_its_first_step_with_one_line",),
        "a recipe whose loss sum has another name trains unwatched: a NaN run commits NaN checkpoints",
    ),
    Mutation(
        "fungitastic-loss-hides-nan", "recipes/fungitastic/model.py",
        "loss = torch.where((target != metadata.UNKNOWN).any(), loss, 0.0)", "loss = torch.nan_to_num(loss)",
        (f"{DIVERGENCE}test_after_a_rollback_train_metrics_are_logged_every_log_every_steps[fungitastic]",),
        "fungitastic's divergence is seen a step late, in the weights, after the NaN step was applied",
    ),
    Mutation(
        "provenance-names-an-enclosing-repository", "common/records/provenance.py",
        '        outside = [path for path in code if not git("ls-tree", "--name-only", "HEAD", "--", path).strip()]',
        "        outside = []",
        ("tests/test_provenance.py::test_code_untracked_inside_another_repository_names_none_of_its_commits",
         "tests/test_provenance.py::test_a_recipe_copied_out_of_the_checkout_trains_and_says_its_version_is_unknown"
         "[inside-another]"),
        "a recipe copied into a user's repository records that repository's commit, which holds none of its code",
    ),
    # ---- issue 38: memory (trainer.out_of_memory=halve, trainer.activation_checkpointing) ------------
    Mutation(
        "retry-forgets-the-samples", "common/run/training_run.py",
        "plan.groups(self._epoch_source(micro_batches, to_device), keep=halving.halves)",
        "plan.groups(self._epoch_source(micro_batches, to_device), keep=False)",
        (f"{REDONE}[fashion_mnist]", f"{REDONE}[timm_imagenet]"),
        "a step that ran out of memory is redone on the next batches: some samples are skipped, others seen twice",
    ),
    Mutation(
        "retry-forgets-the-random-draws", "common/run/out_of_memory.py",
        "        self.step_start.restore()\n", "",
        (f"{REDONE}[fungitastic]", f"{REDONE}[cifar100_resnet50]"),
        "the redone step draws other dropout and augmentation, counts the failed attempt's loss and BatchNorm batches",
    ),
    Mutation(
        "retry-of-a-non-memory-error", "common/run/out_of_memory.py",
        "if not isinstance(error, torch.OutOfMemoryError) or not self.in_forward_backward:",
        "if not self.in_forward_backward:",
        (f"{OOM}test_an_error_that_is_not_memory_is_not_retried",),
        "a bug, a bad input or a NaN check in the loop is retried with smaller micro-batches instead of reported",
    ),
    Mutation(
        "ranks-never-agree-on-the-micro-batch", "common/run/out_of_memory.py",
        "        if len(set(micro_batches)) <= 1:\n            return\n        size = min(micro_batches)",
        "        if True:\n            return\n        size = min(micro_batches)",
        (f"{TWO_RANKS_AGREE}[fashion_mnist-failing0]",),
        "the ranks that did not run out keep the large micro-batch: the run's records and summary disagree with them",
    ),
    Mutation(
        "halve-mode-reduces-no-gradients", "common/run/out_of_memory.py",
        "        all_reduce_gradients(self.model)\n", "",
        (f"{TWO_RANKS_AGREE}[fashion_mnist-failing0]",),
        "with trainer.out_of_memory=halve on several ranks each rank trains on its own gradients: they drift apart",
    ),
    Mutation(
        "fsdp-retry-keeps-its-iteration-state", "common/run/out_of_memory.py",
        "        model.reset_iter_state()\n", "        pass\n",
        (f"{TWO_RANKS_AGREE}[timm_imagenet-fsdp-failing1]",),
        "under FSDP2 the redone step and every later one apply no gradient: the weights stop changing",
    ),
    Mutation(
        "halved-size-forgotten-on-resume", "common/run/out_of_memory.py",
        'if self.mode == "halve" and progress.micro_batch_found_on == self.device_key:',
        "if False:",
        (f"{OOM}test_the_size_is_kept_on_the_same_device_and_tried_again_on_another",),
        "every requeue on the same small GPU runs out of memory again first, and a resumed run is not bit-exact",
    ),
    Mutation(
        "checkpointed-block-redraws-its-dropout", "common/pytorch/activation_checkpointing.py",
        "    return checkpoint(forward, *args, use_reentrant=False, context_fn=",
        "    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, context_fn=",
        (f"{CHECKPOINTED}[fungitastic]", f"{CHECKPOINTED}[timm_imagenet-vit]"),
        "with activation checkpointing, dropout and drop path draw again in the backward pass: wrong gradients",
    ),
    Mutation(
        "checkpointed-block-counts-its-batchnorm-twice", "common/pytorch/activation_checkpointing.py",
        "        norm.momentum = 0.0\n", "        norm.momentum = norm.momentum\n",
        (f"{CHECKPOINTED}[tv_segmentation]", f"{CHECKPOINTED}[cifar100_resnet50]"),
        "with activation checkpointing BatchNorm's running statistics move twice a step: another model is evaluated",
    ),
    # ---- issue 35: what a step costs, and the data that feeds it -------------------------------------
    Mutation(
        "failed-step-leaves-the-flop-counter-on", "common/run/training_run.py",
        "            if self._flop_count is not None:  # a step that failed: its counter must not stay on in this "
        "process",
        "            if False:",
        (f"{DIVERGENCE}test_a_loop_whose_loss_sum_has_another_name_stops_at_its_first_step_with_one_line",),
        "a run whose first step fails in-process (a search trial, a notebook) leaves torch.compile forced eager",
    ),
    Mutation(
        "loader-iterator-per-epoch", "common/run/training_run.py",
        "        if self._stream is None or self._stream[0] is not micro_batches or self._stream_at != at:",
        "        if True:",
        ("tests/test_loaders.py::test_the_next_epochs_first_batches_are_asked_for_before_the_epoch_ends",),
        "every epoch starts its loader anew: the workers decode its first batches only when the GPU waits for them",
    ),
    Mutation(
        "metric-sums-copy-before-adding", "common/pytorch/metrics.py",
        "                value = value.detach().to(self.device)\n",
        "                value = value.detach().to(self.device, self._dtype)\n",
        ("tests/test_step_operators.py::test_a_steady_step_adds_at_most_the_budgeted_operators_to_the_bare_step",),
        "two more kernels in every training step, unnoticed",
    ),
    Mutation(
        "decode-auto-ignores-the-measurements", "common/data/decode_choice.py",
        "decode = Decode.cpu if supply >= HEADROOM * demand else Decode.gpu", "decode = Decode.cpu",
        ("tests/test_decode_choice.py::"
         "test_auto_decodes_on_the_cpu_while_its_cores_keep_up_with_the_model_and_on_the_gpu_below",),
        "data.decode=auto decodes on a node's few cores while the GPU waits",
    ),
    # ---- issue 37: file lists saved once, shards read by index -----------------------------------------
    Mutation(
        "file-list-reused-after-the-tree-changed", "common/data/file_index.py",
        "        changed = index.changes(root)\n        if changed:", "        changed = []\n        if changed:",
        (f"{SOURCES}test_a_changed_tree_stops_with_one_line_and_is_listed_again_only_when_asked",
         f"{SOURCES}test_a_damaged_list_or_one_from_another_tree_stops_with_one_line_naming_it[another tree]"),
        "files added or removed since the list was saved are never read, and a list from another tree trains on "
        "that tree's names",
    ),
    Mutation(
        "file-list-checksum-not-checked", "common/data/file_index.py",
        'if info.get("format") != FORMAT or index.checksum() != info.get("checksum"):',
        'if info.get("format") != FORMAT:',
        (f"{SOURCES}test_a_damaged_list_or_one_from_another_tree_stops_with_one_line_naming_it[checksum]",),
        "a damaged list trains on wrong labels or crops",
    ),
    Mutation(
        "decoded-size-not-checked-against-the-list", "common/data/images.py",
        "    if (decoded[0], decoded[1]) != (math.ceil(height / reduction), math.ceil(width / reduction)):",
        "    if False:",
        (f"{SOURCES}test_a_file_changed_in_place_is_caught_when_it_is_decoded",),
        "an image replaced in place is cropped where it has no pixels (black or shifted crops, no error)",
    ),
    Mutation(
        "other-rank-takes-an-older-list", "common/data/file_index.py",
        '                if index.info.get("token") == token:', "                if True:",
        (f"{SOURCES}test_on_two_ranks_local_rank_0_lists_and_the_other_waits_for_that_list",),
        "after data.rebuild_index=true the ranks of a node train on different file lists",
    ),
    Mutation(
        "shard-reader-orders-itself", "common/data/shards.py",
        "        sample = self.streaming()[index]\n"
        "        name = f\"{self.location}[{index}] ({sample['name']})\"\n"
        "        if sample[\"index\"] != index:",
        "        self.__dict__[\"_read\"] = self.__dict__.get(\"_read\", -1) + 1  # its own order, not the sampler's\n"
        "        sample = self.streaming()[self._read % self.length]\n"
        "        name = f\"{self.location}[{index}] ({sample['name']})\"\n"
        "        if False:",
        (f"{SOURCES}test_shards_from_a_folder_or_a_remote_give_the_batches_evaluation_and_model_of_files"
         "[timm_imagenet-cpu]",
         f"{SOURCES}test_samples_read_by_two_ranks_then_one_are_the_epochs_samples_once_each_as_files_give_them"),
        "runs on shards see other samples and augmentations than on files, and a resume repeats or skips samples",
    ),
    Mutation(
        "shard-order-not-checked", "common/data/shards.py",
        '        if sample["index"] != index:', "        if False:",
        (f"{SOURCES}test_a_shard_set_whose_samples_are_out_of_order_stops_at_the_first_misplaced_sample",),
        "a shard set written or listed out of order trains on the wrong labels without a word",
    ),
    Mutation(
        "shard-sizes-not-checked", "common/data/shards.py",
        '            if size != chunk["chunk_bytes"]:', "            if False:",
        (f"{SOURCES}test_a_truncated_or_missing_shard_stops_before_any_work_with_one_line[truncated]",),
        "a truncated shard makes litdata wait for the rest of the chunk and fail mid-run with a traceback",
    ),
    Mutation(
        "other-datasets-shards-accepted", "common/data/shards.py",
        "        wrong = {key: self.metadata.get(key) for key, value in expect.items() "
        "if self.metadata.get(key) != value}",
        "        wrong = {}",
        (f"{SOURCES}test_shards_of_another_dataset_stop_with_one_line",),
        "a run trains on another dataset's shards, or on labels encoded with other label spaces",
    ),
    Mutation(
        "shard-cache-unbounded", "common/data/shards.py",
        "                streaming._on_demand_bytes = False", "                pass",
        (f"{SOURCES}test_a_remote_is_read_through_a_node_local_cache_bounded_by_its_limit",),
        "reading a remote fills the node's disk with every chunk whatever data.shards.cache_limit says",
    ),
    Mutation(
        "records-import-the-run", "common/records/summary.py",
        "from common.jsonfiles import write_json",
        "from common.jsonfiles import write_json\nfrom common.run.steps import StepPlan  # noqa: F401",
        ("tests/test_layers.py::test_a_module_of_common_imports_only_its_layer_and_those_below[common.records.summary]",),
        "common/ grows an upward import: the next change makes a cycle, and a layer can no longer be read alone",
    ),
    # ---- issue 36: the shared test tables take each recipe's entries from recipes/<recipe>/testing.py
    Mutation(
        "recipe-tables-drop-a-recipe", "tests/recipe_tables.py",
        "DECLARED = {recipe: module for recipe in RECIPES if (module := declaration(recipe)) is not None}",
        "DECLARED = {recipe: module for recipe in RECIPES[1:] if (module := declaration(recipe)) is not None}",
        ("tests/test_config_keys.py::test_every_schema_key_has_a_check_or_a_reason_it_has_no_effect_on_a_cpu",),
        "a recipe (a copied one, say) whose keys the suite no longer checks, without a word",
    ),
    Mutation(
        "new-recipe-leaves-out-the-test-declaration", "tools/new_recipe.py",
        '        if path.is_file() and "__pycache__" not in path.parts:',
        '        if path.is_file() and "__pycache__" not in path.parts and path.name != "testing.py":',
        ("tests/test_new_recipe.py::test_new_recipe_round_trip",),
        "make new-recipe leaves a recipe whose keys have no checks: the suite fails until they are written by hand",
    ),
    Mutation(
        "local-cluster-takes-a-claimed-port", "tools/slurm_local_cluster.sh",
        """        if [[ $claimed != *" $p "* ]] && ! port_in_use "$p" && ! port_in_use "$((p + 1))"; then""",
        """        if ! port_in_use "$p" && ! port_in_use "$((p + 1))"; then""",
        ("tests/test_local_slurm.py::test_a_port_another_starting_cluster_claimed_is_not_picked",),
        "the one-node and two-node test clusters, started at once on two xdist workers, take the same slurmctld "
        "port and one of them fails to start",
    ),
    # ---- issue 42: shards, file lists and data.decode=auto on a GPU cluster
    Mutation(
        "shard-reader-shared-with-forked-workers", "common/data/shards.py",
        "        if self._streaming is None or self._streaming_pid != os.getpid():",
        "        if self._streaming is None:",
        (f"{SOURCES}test_chunks_the_main_process_never_read_are_read_by_the_forked_workers_after_decode_auto_measured",),
        "with data.decode=auto on a GPU, rank 0's loader workers wait 120 s for each chunk of a remote shard set "
        "and the run dies with a traceback",
    ),
    Mutation(
        "rebuilt-list-waiters-stop-on-the-damaged-one", "common/data/file_index.py",
        "                try:\n                    index = FileIndex.load(path)\n                except UserError:\n"
        "                    continue\n",
        "                index = FileIndex.load(path)\n",
        (f"{SOURCES}test_on_two_ranks_local_rank_0_lists_and_the_other_waits_for_that_list[a damaged list]",),
        "data.rebuild_index=true on several ranks per node stops with the line that asks for data.rebuild_index=true",
    ),
    Mutation(
        "decode-auto-measures-the-full-batch", "recipes/timm_imagenet/train.py",
        "device, micro_batch=run.micro_batch,", "device, micro_batch=cfg.trainer.batch_size,",
        ("tests/test_decode_choice.py::"
         "test_a_resumed_run_whose_checkpoint_holds_no_choice_measures_the_model_at_its_halved_micro_batch",),
        "a run requeued onto a smaller GPU runs out of memory in data.decode=auto's measurement, before it can halve",
    ),
    Mutation(
        "decode-auto-measurement-stops-on-out-of-memory", "common/data/decode_choice.py",
        "                except torch.OutOfMemoryError:\n                    model.zero_grad(set_to_none=True)",
        "                except ValueError:\n                    model.zero_grad(set_to_none=True)",
        ("tests/test_decode_choice.py::"
         "test_a_model_that_runs_out_of_memory_is_measured_with_half_the_batch_and_left_as_it_was",),
        "a config tuned on a bigger GPU stops in data.decode=auto's measurement instead of training with halved "
        "micro-batches",
    ),
    Mutation(
        "gpu-decoder-hides-out-of-memory", "common/data/device_input.py",
        "            return self.decode_on_device(pieces)\n        except torch.OutOfMemoryError:\n            raise\n",
        "            return self.decode_on_device(pieces)\n",
        ("tests/test_out_of_memory.py::test_the_gpu_decoder_running_out_of_memory_is_the_runs_to_handle",),
        "under memory pressure every step decodes image by image, then on the CPU, and trainer.out_of_memory=halve "
        "never sees it",
    ),
    Mutation(
        "decode-choice-not-kept-on-resume", "recipes/timm_imagenet/train.py",
        "                                 resumed=progress.decode)", "                                 resumed=\"\")",
        ("tests/test_decode_choice.py::"
         "test_a_resume_decodes_as_the_run_began_and_ends_with_the_digest_of_an_uninterrupted_run",),
        "a run requeued onto another node decodes the other way, draws other augmentations, and no longer ends "
        "with the digest of an uninterrupted run",
    ),
    Mutation(
        "stage-to-local-with-shards-ignored", "recipes/timm_imagenet/train.py",
        "    if cfg.data.stage_to_local and cfg.data.format == DataFormat.shards:",
        "    if False:",
        (f"{SOURCES}test_staging_shards_to_local_disk_is_refused_in_one_line",),
        "data.stage_to_local=true with shards copies nothing, without a word",
    ),
    # ---- issue 43: the device-side input in a few passes over the batch, its copy overlapping the step before
    Mutation(
        "device-input-reads-the-channels-back", "common/data/device_input.py",
        "    return red * _GREY_WEIGHTS[0] + green * _GREY_WEIGHTS[1] + blue * _GREY_WEIGHTS[2]",
        "    return (torch.cat([red, green, blue], 1) * torch.tensor(_GREY_WEIGHTS).view(1, 3, 1, 1))"
        ".sum(1, keepdim=True)",
        ("tests/test_images.py::test_the_device_input_reads_and_writes_the_batch_at_most_four_times_once_compiled",),
        "the compiled colour jitter writes the batch out and reads it back at every op: milliseconds of every GPU "
        "step",
    ),
    # ---- issue 44: no import circles; a copied recipe trains as its original does ---------------------
    Mutation(
        "spec-imports-its-train-lazily", "recipes/fashion_mnist/spec.py",
        "def model_from_export(model_cfg: ModelConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:\n"
        "    return build_model(model_cfg)",
        "def model_from_export(model_cfg: ModelConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:\n"
        "    from recipes.fashion_mnist.train import train  # noqa: F401\n    return build_model(model_cfg)",
        (f"{LAYERS}test_no_module_imports_itself_through_others",),
        "python -m recipes.fashion_mnist.train loads its loop twice, and the order of imports decides what works",
    ),
    Mutation(
        "divergence-imports-the-run-for-typing", "common/run/divergence.py",
        "from typing import Any, Protocol\n",
        "from typing import TYPE_CHECKING, Any, Protocol\n\nif TYPE_CHECKING:\n"
        "    from common.run.training_run import TrainingRun  # noqa: F401\n",
        (f"{LAYERS}test_no_module_imports_itself_through_others",),
        "common/run's modules import each other again: which one may import which depends on import order",
    ),
    Mutation(
        "makefile-reads-one-recipes-make-declaration", "Makefile",
        "include $(wildcard recipes/*/recipe.mk)", "include $(wildcard recipes/fashion_mnist/recipe.mk)",
        (f"{COPY_TRAINS}[fashion_mnist-True]",),
        "make train-<a copy of fashion_mnist> stops: its data directory does not exist",
    ),
    Mutation(
        "new-recipe-omits-the-data-prep-command", "tools/new_recipe.py",
        "    return [*commands, train,", "    return [train,",
        (f"{COPY_TRAINS}[timm_imagenet-False]",),
        "a copy of timm_imagenet, trained as the tool says, stops: its data directory does not exist",
    ),
    # ---- issue 43: telemetry that adds up, a start-up that is accounted for --------------------------
    Mutation(
        "images-per-s-counts-evaluations", "common/records/telemetry.py",
        '        metrics = {"train/images_per_s": self.samples * world_size / training,',
        '        metrics = {"train/images_per_s": self.samples * world_size / (training + self._excluded),',
        ("tests/test_telemetry.py::"
         "test_images_per_s_counts_the_time_step_s_counts_in_a_window_that_holds_a_slow_evaluation",),
        "the window holding an epoch's evaluation logs images/s well below its step time's, and looks like a slowdown",
    ),
    Mutation(
        "start-up-phases-overlap", "common/records/startup.py",
        "        self._phase_start = now\n", "",
        ("tests/test_startup.py::test_every_recipe_times_its_start_up_phases_in_order_to_its_first_step[fashion_mnist]",),
        "every start-up phase counts from the process's start: they add up to more than the start-up took",
    ),
    Mutation(
        "start-up-ends-before-the-first-step", "common/run/training_run.py",
        "            self._end_startup(startup.FIRST_STEP)", "            self._end_startup(None)",
        ("tests/test_startup.py::test_every_recipe_times_its_start_up_phases_in_order_to_its_first_step[timm_imagenet]",
         "tests/test_startup.py::"
         "test_summary_json_and_the_first_log_hold_the_start_up_of_the_segment_that_wrote_them_printed_once"),
        "the first step's autotuning, compilation and FLOP count are missing from the start-up",
    ),
    Mutation(
        "start-up-in-every-log", "common/run/training_run.py",
        "            self._startup_logged = True\n", "",
        ("tests/test_startup.py::"
         "test_summary_json_and_the_first_log_hold_the_start_up_of_the_segment_that_wrote_them_printed_once",),
        "every training log repeats the segment's start-up",
    ),
    Mutation(
        "decode-choice-not-timed", "recipes/timm_imagenet/train.py",
        "    startup.done(startup.DECODE_CHOICE)\n", "",
        ("tests/test_startup.py::test_every_recipe_times_its_start_up_phases_in_order_to_its_first_step[timm_imagenet]",),
        "data.decode=auto's measurement hides in the first step's time",
    ),
    Mutation(
        "start-up-taken-by-any-run", "common/records/startup.py",
        "    if _current is None or _current.claimed:\n", "    if _current is None:\n",
        ("tests/test_startup.py::"
         "test_a_run_that_times_no_start_up_records_none_after_a_run_stopped_before_its_first_step",),
        "in a notebook or a search's trials, a run reports the start-up of one that stopped before its first step",
    ),
    # ---- issue 46, item 1: trainer.eval_every_steps ---------------------------------------------------
    Mutation(
        "no-evaluation-mid-epoch", "common/run/training_run.py",
        "evaluating = self.evaluations.mid_epoch(progress.step) and not plan.epoch_done()", "evaluating = False",
        (EVAL_TIMM,),
        "trainer.eval_every_steps evaluates only where an epoch ends: a one-epoch run evaluates once, at its end",
    ),
    Mutation(
        "stop-signal-skips-the-evaluation", "common/run/training_run.py",
        "                    progress.evaluation_owed = True\n", "                    pass\n",
        (EVAL_RESUMED,),
        "a run pre-empted at an evaluation's step never evaluates there: its eval/* history and best checkpoint "
        "differ from an uninterrupted run's",
    ),
    Mutation(
        "mid-epoch-evaluation-not-checkpointed", "common/run/training_run.py",
        "        self.save(metrics, milestone=self.milestones.get(self.progress.epoch) if epoch_done else None)\n",
        "        if epoch_done:\n            self.save(metrics, milestone=self.milestones.get(self.progress.epoch))\n",
        (EVAL_TIMM,),
        "a mid-epoch evaluation leaves no checkpoint: its best is never kept, and a kill soon after loses the steps",
    ),
    Mutation(
        "loader-restarts-after-a-mid-epoch-evaluation", "common/run/training_run.py",
        "self._stream_at = (self.sampler.epoch, self.sampler.consumed) if self._mid_epoch_evaluation else None",
        "self._stream_at = None",
        (EVAL_TIMM,),
        "after each mid-epoch evaluation the training loader starts anew: its workers and prefetched batches are lost",
    ),
    Mutation(
        "search-hears-evaluations-by-epoch", "common/run/training_run.py",
        "at = self.progress.step if self.evaluations.by_steps else self.progress.epoch",
        "at = self.progress.epoch",
        (EVAL_RESUMED,),
        "a search's pruner hears only the first evaluation of each epoch (Optuna ignores repeats of a step)",
    ),
    Mutation(
        "early-stopping-only-at-epoch-ends", "common/run/training_run.py",
        "            self._count_improvement(metrics, may_stop=True)\n",
        "            self._count_improvement(metrics, may_stop=epoch_done)\n",
        (f"{EVAL_STEPS}test_early_stopping_counts_evaluations_every_n_steps",),
        "trainer.early_stopping_patience waits for an epoch's end: a one-epoch run never stops early",
    ),
    Mutation(
        "negative-eval-every-steps-accepted", "common/run/cadence.py",
        "        if self.every_steps < 0:\n", "        if False:\n",
        (f"{EVAL_STEPS}test_a_bad_evaluation_cadence_is_refused_in_one_line[negative]",),
        "trainer.eval_every_steps=-1 silently evaluates by epochs",
    ),
    Mutation(
        "both-evaluation-cadences-accepted", "common/run/cadence.py",
        "        if self.every_steps and self.every_epochs != 1:\n", "        if False:\n",
        (f"{EVAL_STEPS}test_a_bad_evaluation_cadence_is_refused_in_one_line[both-cadences]",),
        "trainer.eval_every_epochs is silently ignored when trainer.eval_every_steps is set",
    ),
    # ---- issue 46, item 2: progressive resizing (data.progressive) ------------------------------
    Mutation(
        "progressive-size-not-rounded-to-the-step", "common/data/progressive.py",
        "        return self.step * round(grown / self.step)", "        return int(grown)",
        (f"{PROGRESSIVE}test_each_epochs_size_is_ffcvs_and_depends_on_the_epoch_alone",),
        "epochs between the ramp's ends train at sizes that are no multiple of the step (FFCV's 32 px)",
    ),
    Mutation(
        "progressive-every-epoch-at-the-start-size", "common/data/progressive.py",
        "        return self.by_size[self.sizes.of_epoch(key[0])][key]",
        "        return self.by_size[self.sizes.start][key]",
        (f"{PROGRESSIVE}test_each_sample_is_made_at_its_epochs_size_as_the_run_of_that_size_makes_it",
         PROGRESSIVE_TIMM),
        "the size never grows: every epoch trains at data.progressive.start_size",
    ),
    Mutation(
        "progressive-device-crops-at-the-end-size", "common/data/device_input.py",
        '        size = int(batch["output_size"][0])', "        size = self.augmentation.size",
        (f"{PROGRESSIVE}test_each_sample_is_made_at_its_epochs_size_as_the_run_of_that_size_makes_it",),
        "with data.decode=gpu every epoch trains at the full size: progressive resizing does nothing",
    ),
    Mutation(
        "progressive-sizes-share-a-dynamic-graph", "common/run/steps.py",
        "    return torch.compile(model, dynamic=False)", "    return torch.compile(model, dynamic=None)",
        (f"{PROGRESSIVE}test_under_compile_each_size_compiles_once_and_no_step_recompiles",),
        "under trainer.compile the third size and after run a slower dynamic-shape graph",
    ),
    Mutation(
        "progressive-sizes-off-the-step-accepted", "common/data/progressive.py",
        "        if cfg.start_size % cfg.step or end % cfg.step:", "        if False:",
        (f"{PROGRESSIVE}test_bad_values_are_one_line_errors",),
        "a start or end size off the step makes a ramp whose sizes jump past its own ends",
    ),
    Mutation(
        "progressive-size-not-logged", "recipes/timm_imagenet/train.py",
        '"train/lr": optimizer.param_groups[0]["lr"]} | sizes.logged(progress.epoch))',
        '"train/lr": optimizer.param_groups[0]["lr"]})',
        (PROGRESSIVE_TIMM,),
        "the logs do not say at which size each step trained (train/image_size)",
    ),
    Mutation(
        "progressive-fungitastic-vit-of-one-size", "recipes/fungitastic/spec.py",
        "any_size=cfg.data.progressive.start_size > 0)", "any_size=False)",
        (f"{PROGRESSIVE}test_fungitastic_builds_its_vit_for_any_size_and_trains_each_epoch_at_its_size",),
        "fungitastic's ViTs stop at start-up with data.progressive on",
    ),
    Mutation(
        "progressive-patches-that-do-not-tile-a-size", "common/data/progressive.py",
        "any(size % side for size in sizes.distinct() for side in patch)", "False",
        (f"{PROGRESSIVE}test_fungitastic_builds_its_vit_for_any_size_and_trains_each_epoch_at_its_size",),
        "a ViT whose patches do not tile an epoch's size fails at that epoch's first step with a traceback",
    ),
    # issue 45, item 3: knowledge distillation (common/after_training/distill.py)
    Mutation(
        "distill-alpha-does-not-mix", "common/after_training/distill.py",
        "    return (1 - distill.alpha) * loss + distill.alpha * soft",
        "    return loss + distill.alpha * soft",
        ("tests/test_distill.py::test_the_loss_is_the_recipes_and_the_soft_target_loss_mixed_by_alpha",),
        "distill.alpha=1 still trains on the labels: the student does not learn the teacher's outputs",
    ),
    Mutation(
        "teacher-counted-in-mfu", "common/records/telemetry.py",
        "        return float(self._counter.get_total_flops() - self._excluded)",
        "        return float(self._counter.get_total_flops())",
        ("tests/test_distill.py::test_the_teachers_forward_is_left_out_of_the_flops_behind_mfu",),
        "train/mfu counts the teacher's forward as the model's work and overstates the student's utilisation",
    ),
    Mutation(
        "teacher-not-checked-on-resume", "common/run/training_run.py",
        "            check_resumed(self.progress.teacher, self.teacher)\n", "",
        ("tests/test_distill.py::test_a_resume_checks_the_teacher_is_the_one_the_run_began_with",),
        "a resumed run silently distils from another teacher than the one it began with",
    ),
    Mutation(
        "teacher-not-recorded", "common/run/training_run.py",
        "            self.progress.teacher = self.teacher.record() if self.teacher is not None else {}\n", "",
        ("tests/test_distill.py::test_a_resume_checks_the_teacher_is_the_one_the_run_began_with",),
        "a run's checkpoints do not say which teacher it distils from, so a resume cannot check it",
    ),
    Mutation(
        "teacher-classes-by-count", "common/after_training/distill.py",
        "        if theirs[name] != ours[name]:", "        if len(theirs[name]) != len(ours[name]):",
        ("tests/test_distill.py::test_a_teacher_of_other_classes_or_another_input_is_a_one_line_error_at_the_start",),
        "a teacher of other classes (as many) teaches the wrong class for each output",
    ),
    Mutation(
        "teacher-in-training-mode", "common/after_training/distill.py",
        "    model = on_device(model.eval(), device, cfg.trainer.channels_last)",
        "    model = on_device(model, device, cfg.trainer.channels_last)",
        ("tests/test_distill.py::test_a_teacher_and_its_export_are_the_same_teacher",),
        "the teacher's BatchNorm and dropout behave as in training: its targets are noisy and its statistics drift",
    ),
    Mutation(
        "teacher-sees-the-batch-before-mixup", "recipes/timm_imagenet/train.py",
        "                        teacher_logits = teacher.model(images)",
        "                        teacher_logits = teacher.model(train_input(inputs))",
        ("tests/test_distill.py::test_the_teacher_sees_the_students_batch_after_mixup[timm_imagenet]",),
        "the teacher predicts unmixed images while the student is trained on mixed ones: its targets are wrong",
    ),
    # ---- make predict (issue 45, item 1) ---------------------------------------------------------
    Mutation(
        "predict-ignores-the-ema", "common/after_training/predict.py",
        "        if ema is not None:  # what make export takes: the EMA where the run keeps one\n",
        "        if False:\n",
        (PREDICTED_SPLIT,),
        "make predict on a run with an EMA uses the raw weights, not those make export and make eval report",
    ),
    Mutation(
        "predict-timm-without-the-centre-crop", "recipes/timm_imagenet/spec.py",
        '"crop_pct": entry["crop_pct"],', '"crop_pct": 1.0,',
        (PREDICTED_SPLIT,),
        "timm_imagenet predicts on images transformed otherwise than its evaluation transforms them",
    ),
    Mutation(
        "predict-fashion-mnist-unnormalised", "recipes/fashion_mnist/spec.py",
        "lambda batch: normalize(batch[:, 0].to(device, non_blocking=True))",
        "lambda batch: batch.to(device, non_blocking=True).float() / 255.0",
        (PREDICTED_SPLIT,),
        "fashion_mnist's predictions on image files are those of unnormalised input",
    ),
    Mutation(
        "predict-cifar-on-the-0-255-scale", "recipes/cifar100_resnet50/spec.py",
        "lambda batch: normalize(batch.to(device, non_blocking=True).float() / 255.0)",
        "lambda batch: normalize(batch.to(device, non_blocking=True).float())",
        (f"{PREDICT}test_cifar_images_from_files_predict_as_the_split_evaluates[cifar100_resnet50-cifar_run-eval_ema]",),
        "cifar100_resnet50's predictions on image files are those of input 255 times too large",
    ),
    Mutation(
        "predict-decompression-bomb-is-a-traceback", "common/data/images.py",
        'ValueError, Image.DecompressionBombError) as error:\n        raise UserError(f"{path} is not a readable image',
        'ValueError) as error:\n        raise UserError(f"{path} is not a readable image',
        (UNREADABLE,),
        "one image over PIL's decompression-bomb limit stops make predict (and training) with a traceback",
    ),
    Mutation(
        "predict-error-not-in-the-csv", "common/after_training/predict.py",
        '                rows[index]["error"] = error\n', "",
        (UNREADABLE,),
        "the CSV does not say which files could not be read",
    ),
    Mutation(
        "predict-exit-0-when-nothing-read", "common/after_training/predict.py",
        '    if all("error" in row for row in rows):\n', "    if not rows:\n",
        (UNREADABLE,),
        "make predict on a folder of unreadable files succeeds with an empty CSV",
    ),
    Mutation(
        "predict-fungitastic-species-only", "recipes/fungitastic/spec.py",
        "scores=lambda outputs: {level: outputs[level] for level in levels})",
        "scores=lambda outputs: {levels[0]: outputs[levels[0]]})",
        (f"{PREDICT}test_fungitastic_predicts_every_taxonomic_level",),
        "fungitastic's predictions name one taxonomic level, not every level it predicts",
    ),
    Mutation(
        "predict-masks-at-the-model-input-size", "common/after_training/predict.py",
        'size=(height, width), mode="bilinear"', 'size=(in_height, in_width), mode="bilinear"',
        (f"{PREDICT}test_tv_segmentation_writes_a_palette_mask_per_image_and_the_pixel_shares",),
        "tv_segmentation's masks are not the size of their images",
    ),
    Mutation(
        "predict-list-relative-to-the-working-directory", "common/after_training/predict.py",
        "paths = [path.parent / line.strip() for line", "paths = [Path(line.strip()) for line",
        (f"{PREDICT}test_an_export_folder_alone_predicts_what_its_run_predicts",),
        "INPUT=<list.txt> with relative paths reads them from wherever make was started",
    ),
    # ---- make average and the checkpoints it averages (issue 45) --------------------------------
    Mutation(
        "average-not-divided", "common/after_training/average.py",
        "(totals[key] / count).to(value.dtype)", "totals[key].to(value.dtype)",
        (f"{AVERAGE}test_the_average_of_two_is_the_elementwise_mean_of_their_ema",),
        "an average of two checkpoints holds their sum",
    ),
    Mutation(
        "average-counters-of-the-oldest", "common/after_training/average.py",
        "if key in totals else value.clone()", "if key in totals else state[key].clone()",
        (f"{AVERAGE}test_the_average_of_two_is_the_elementwise_mean_of_their_ema",),
        "BatchNorm's num_batches_tracked of an average is the oldest checkpoint's",
    ),
    Mutation(
        "average-last-takes-the-oldest", "common/after_training/average.py",
        "        found = newest_steps(folder)\n", "        found = newest_steps(folder)[::-1]\n",
        (f"{AVERAGE}test_the_average_of_one_checkpoint_is_that_checkpoint",),
        "LAST=k averages the oldest kept checkpoints",
    ),
    Mutation(
        "average-batchnorm-not-recomputed", "common/after_training/average.py",
        "    update_bn(counted(), model)\n", "",
        (f"{AVERAGE}test_batchnorm_statistics_are_those_of_the_averaged_weights",),
        "an average keeps the mean of BatchNorm statistics, which do not fit the averaged weights",
    ),
    Mutation(
        "average-batchnorm-of-other-weights", "common/after_training/average.py",
        "                    model.load_state_dict(averaged)\n", "                    pass\n",
        (f"{AVERAGE}test_batchnorm_statistics_are_those_of_the_averaged_weights",),
        "the averaged checkpoint holds freshly initialised weights with their BatchNorm statistics",
    ),
    Mutation(
        "average-batchnorm-of-val-images", "recipes/timm_imagenet/spec.py",
        "_evaluation_images(cfg, dist_info, cfg.data.train_split)",
        "_evaluation_images(cfg, dist_info, cfg.data.val_split)",
        (f"{AVERAGE}test_a_timm_resnet_gets_batchnorm_statistics_from_its_training_images",),
        "make average fits BatchNorm's statistics to the validation images it is then evaluated on",
    ),
    Mutation(
        "average-of-another-model", "common/after_training/average.py",
        "            _check_same_run(chosen[0], found_dir)\n", "",
        (f"{AVERAGE}test_checkpoints_of_another_model_are_one_line_and_exit_2[model-config]",
         f"{AVERAGE}test_checkpoints_of_another_model_are_one_line_and_exit_2[recipe]"),
        "checkpoints of two model configs are averaged into weights that fit neither",
    ),
    Mutation(
        "average-not-read-by-name", "common/after_training/trained.py",
        "    return bool(CHECKPOINT_DIR.match(name) or AVERAGE_DIR.match(name))",
        "    return bool(CHECKPOINT_DIR.match(name))",
        (f"{AVERAGE}test_eval_export_predict_and_init_from_read_the_average_by_name",),
        "make eval WHICH=average-last-3 says there is no such checkpoint",
    ),
    Mutation(
        "average-in-the-layout", "common/after_training/average.py",
        '    return f"average-{how}-{count}"', '    return f"AtomicDirectory_checkpoint_{count}0_force"',
        (f"{AVERAGE}test_a_resume_never_takes_the_average_and_retention_leaves_it",),
        "the averaged checkpoint is written as a checkpoint of the run, which retention deletes or a resume takes",
    ),
    Mutation(
        "whole-weights-into-a-sharded-model", "common/after_training/trained.py",
        "        elif is_sharded(model):", "        elif False:",
        (f"{AVERAGE}test_dinov2_shards_of_two_ranks_average_into_weights_one_rank_evaluates_sharded_or_whole",),
        "make eval of a dinov2_fsdp average with its model sharded says the checkpoint does not fit",
    ),
    Mutation(
        "keep-best-k-pruned", "common/checkpoint/manager.py",
        "        keep |= {found_dir.path for found_dir in self._kept_best()}\n", "",
        (f"{KEEP_BEST_K}",),
        "checkpoint.keep_best_k=3 keeps only the best, and make average BEST=3 has nothing to average",
    ),
    Mutation(
        "keep-best-k-not-force", "common/checkpoint/manager.py",
        "force = new_best or kept_best or milestone is not None", "force = new_best or milestone is not None",
        (f"{KEEP_BEST_K}",),
        "on the ISC, the k best checkpoints are not shipped by a sync",
    ),
    # ---- dinov2_fsdp's linear-evaluation sweep (issue 46, item 3) --------------------------------
    Mutation(
        "probe-one-lr-grows-probe-heads", "recipes/dinov2_fsdp/spec.py",
        "    return heads if len(heads) > 1 else []\n", "    return heads\n",
        (f"{SWEEP}test_one_probe_lr_is_the_plain_probe_and_ends_with_its_digest",),
        "a run with one probe LR no longer ends with the digest it had before the sweep existed",
    ),
    Mutation(
        "probe-heads-losses-averaged", "recipes/dinov2_fsdp/train.py",
        "for head in logits]).sum()", "for head in logits]).mean()",
        (f"{SWEEP}test_each_head_trains_as_alone_at_its_lr_on_one_backbone_forward",),
        "each head's gradient shrinks with the number of heads: a head trains differently in a sweep than alone",
    ),
    Mutation(
        "probe-heads-share-one-lr", "recipes/dinov2_fsdp/train.py",
        'group | {"lr": lr}', 'group | {"lr": lrs[0]}',
        (f"{SWEEP}test_each_head_trains_as_alone_at_its_lr_on_one_backbone_forward",),
        "every head of the sweep trains at the first LR: the sweep compares nothing",
    ),
    Mutation(
        "probe-best-head-not-taken", "recipes/dinov2_fsdp/train.py",
        "        model.take_probe_head(best)\n", "",
        (f"{SWEEP}test_every_variant_is_evaluated_and_the_fine_tune_starts_from_the_best",
         f"{SWEEP}test_a_sharded_probe_only_sweep_ends_with_the_best_head_and_exports_without_the_others"),
        "the fine-tune starts from an untrained head, whatever the sweep found",
    ),
    Mutation(
        "probe-head-columns-from-the-first-block", "recipes/dinov2_fsdp/model.py",
        "    start = (class_tokens(features) - class_tokens(part)) * width\n", "    start = 0\n",
        (f"{SWEEP}test_every_variant_is_evaluated_and_the_fine_tune_starts_from_the_best",),
        "a head of the last block's class token reads the fourth-last block's: DINOv2's variants are mislabelled",
    ),
    Mutation(
        "probe-best-written-to-gathered-weights", "recipes/dinov2_fsdp/model.py",
        "            self.reshard()\n", "            pass\n",
        (f"{SWEEP}test_under_fsdp2_the_best_head_is_written_to_the_shards_when_the_root_holds_gathered_weights",),
        "under FSDP2 the best head is copied into the root's gathered weights and lost when they are freed",
    ),
    Mutation(
        "probe-finetune-lr-of-the-first-head", "recipes/dinov2_fsdp/train.py",
        'best = progress.extra["probe"]["best"] if sweeping else 0', "best = 0",
        (f"{SWEEP}test_every_variant_is_evaluated_and_the_fine_tune_starts_from_the_best",),
        "the fine-tune's LR follows the sweep's first head, not the one it starts from",
    ),
    Mutation(
        "probe-heads-exported", "common/after_training/export.py",
        "    weights = {key: value for key, value in weights.items() if not key.startswith(spec.training_only)}\n",
        "",
        (f"{SWEEP}test_a_sharded_probe_only_sweep_ends_with_the_best_head_and_exports_without_the_others",),
        "make export of a sweep run fails: its probe heads have no export name",
    ),
    Mutation(
        "probe-four-blocks-read-one", "recipes/dinov2_fsdp/model.py",
        "    return 4 if features in (Features.cls4, Features.cls4_patch_mean) else 1\n",
        "    return 1\n",
        ("tests/test_dinov2_fsdp.py::test_the_last_four_blocks_class_tokens_are_read_from_one_forward",),
        "model.features=cls4 reads the last block's class token alone",
    ),
]
