"""Durable tasks: the state machine, the event log, the runner and recovery (LMSP §6, §11)."""
