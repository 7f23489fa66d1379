"""Hyperparameter search whose trials are ordinary, resumable runs of a recipe.

    python -m tools.search <recipe> --trials N [--space FILE | PRESET] [--study DIR] [--storage URL]
        [--nproc N] [-- overrides]
    python -m tools.search <recipe> --study DIR --report
    make search-<recipe> SPACE=<file> TRIALS=N STUDY=<dir> [ARGS="overrides"] [NPROC=n] [REPORT=1]

An Optuna study (its sampler, TPE; its pruner) over the space of a small YAML file
(``tools/search/space.py``; presets in ``conf/search/``). Every trial is a run of the recipe with
the overrides and the trial's parameters, in its own run directory ``<study>/trial_<n>/``, so
``make eval-``, ``make export`` and ``make compare`` work on trials as on any run. Any number of
workers run the same command at once and share the study through Optuna's journal file in the
study folder (no database server; ``--storage`` takes a database URL instead); each takes its
next trial as soon as it is free. The search ends when the study has N finished trials (complete,
pruned or failed), whichever workers ran them.

A trial interrupted by pre-emption or a kill is resumed from its checkpoint by the next worker,
never restarted nor counted twice (``tools/search/worker.py``); each evaluation is reported to
the study so its pruner can stop a trial early (``common/run/search_trial.py``, through the run
contract, so every recipe has it); results go to ``<study>/study.json``, a table and PNG plots
(``tools/search/results.py``).
"""
