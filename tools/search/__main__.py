"""``python -m tools.search``: see the package's docstring (``tools/search/__init__.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.entry import fail
from common.errors import UserError
from tools.search.isc import restore_journal
from tools.search.results import table, write_plots, write_study_json
from tools.search.space import check_against_recipe, load_space, override_key, space_file
from tools.search.study import JOURNAL, Search, Settings, open_search, start_search
from tools.search.worker import Worker, say


def positive(text: str) -> int:
    value = int(text) if text.isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, not {text!r}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options, and the Hydra overrides for every trial: everything after ``--``."""
    options, overrides = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m tools.search",
                                     usage="%(prog)s recipe [options] [-- overrides for every trial]")
    parser.add_argument("recipe")
    parser.add_argument("--space", help="a search space file, or a preset in conf/search/ (default: the recipe's)")
    parser.add_argument("--trials", type=positive, help="the number of finished trials the study should reach")
    parser.add_argument("--study", help="the study folder (default: runs/<recipe>/search)")
    parser.add_argument("--storage", help="a database URL for the study instead of its journal file")
    parser.add_argument("--nproc", type=positive, default=1, help="processes per trial (torchrun)")
    parser.add_argument("--checkpoint-artifacts", help="the ISC's $CHECKPOINT_ARTIFACT_PATH: the running trial "
                        "checkpoints there and the journal is kept there (one worker per experiment)")
    parser.add_argument("--report", action="store_true", help="print the table, write study.json and the plots")
    args = parser.parse_args(options)
    args.overrides = overrides
    return args


def report(search: Search) -> None:
    """The table on stdout; study.json and the plots in the study folder."""
    print(table(search), flush=True)
    say(f"study.json: {write_study_json(search)}")
    for line in write_plots(search):
        say(line)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    study_dir = Path(args.study or f"runs/{args.recipe}/search").resolve()
    try:
        if args.report:
            report(open_search(study_dir, args.storage, args.recipe))
            return 0
        if args.trials is None:
            raise UserError("--trials (TRIALS=) is required: the number of finished trials the study should reach")
        space = load_space(space_file(args.space, args.recipe))
        objective = check_against_recipe(space, args.recipe, args.overrides)
        settings = Settings.from_space(args.recipe, args.overrides, space, objective)
        artifacts = None
        if args.checkpoint_artifacts:
            artifacts = Path(args.checkpoint_artifacts).resolve()
            if not artifacts.is_dir() or args.storage:
                raise UserError(f"--checkpoint-artifacts {artifacts}: must be a folder (the ISC's "
                                f"$CHECKPOINT_ARTIFACT_PATH), and the study's storage its journal (no --storage)")
            if any(override_key(override) == "checkpoint.keep_best" for override in args.overrides):
                raise UserError("--checkpoint-artifacts: trials keep no best checkpoint there (checkpoint.keep_best "
                                "is false; see docs/clusters.md), so the overrides cannot set it")
            restore_journal(study_dir / JOURNAL, artifacts, say)
        search = start_search(study_dir, args.storage, settings, say)
        code = Worker(search, args.trials, args.nproc, artifacts).run()
        report(search)
        return code
    except UserError as error:
        fail(str(error))


if __name__ == "__main__":
    raise SystemExit(main())
