"""Inference: llama.cpp's own server, one process per loaded model, remote endpoints, and the model registry."""
