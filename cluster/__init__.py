"""Getting a run onto machines: torchrun with one process's exit codes, pre-flight checks, the doctor."""
