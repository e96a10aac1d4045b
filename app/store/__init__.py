"""Persistence: one SQLite file per user (LMSP §11.1)."""
