"""Troubleshooting (conf/troubleshoot/): out-of-memory recovery, memory tracking and the doctor report."""
from framework.troubleshoot.memory import MemoryTracker
from framework.troubleshoot.oom import DoesNotFitError, OOMRecovery

__all__ = ["DoesNotFitError", "MemoryTracker", "OOMRecovery"]
