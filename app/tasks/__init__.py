"""Durable tasks: the state machine, the event log, the scheduler with its task kinds, and
recovery (LMSP §6, §11)."""
