"""The small layer every recipe shares: distributed set-up, resumable sampling,
atomic checkpoints, exact metric reduction, logging and pre-emption handling.

There is deliberately no training loop here: each recipe's ``train.py`` owns its loop.
"""
