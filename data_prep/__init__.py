"""One script per recipe: download or copy the data, verify checksums, convert.

Run as ``python -m data_prep.<recipe>`` or ``make prep-<recipe> [SOURCE=...]``.
"""
