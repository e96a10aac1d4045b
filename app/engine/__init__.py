"""Inference: llama.cpp in a child process, and the model registry."""
