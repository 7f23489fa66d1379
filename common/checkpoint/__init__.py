"""Atomic, verified checkpoints in the ISC's AtomicDirectory layout: layout, writer, manager."""
