"""LMSP Tray: local language models for the other apps on this computer."""

__version__ = "0.1.0"
