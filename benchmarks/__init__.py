"""``make bench``: side-by-side measurements written to ``benchmarks/RESULTS.md``.

Each module here (except ``run`` and ``results``) defines ``run(quick: bool) -> list[Result]``;
``python -m benchmarks.run`` collects them all. Nothing here is a timed test.
"""
