"""The mutations ``tools/mutation_check.py`` applies: each one a bug that would hurt users, the
exact source text it replaces, and the tests that must catch it."""

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


MUTATIONS: list[Mutation] = [
    Mutation(
        "extended-run-stays-finished", "recipes/fashion_mnist/train.py",
        "progress.finished = False  # a finished run restarted with more epochs or steps goes on", "pass",
        ("tests/test_fashion_mnist.py::test_a_finished_run_extended_on_another_number_of_ranks_continues",),
        "a finished run restarted with more epochs reports its old metrics and writes no final checkpoint",
    ),
]
