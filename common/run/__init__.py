"""The run itself: the loop's contract (``TrainingRun``), its steps and the guards on them."""
