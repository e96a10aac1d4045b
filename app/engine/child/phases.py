"""What the engine child is doing, said to its parent through one shared byte."""

from __future__ import annotations

# What the process is doing, in a byte of memory it shares with the parent, which reads it once
# the process has died (app/engine/parent/engine.py): fast mode changes only llama.cpp's compute kernels
# (KERNELS: loading, the warm-up, reading a prompt, decoding a token), so only a crash there is
# fast mode's to answer for. The request's grammar (GRAMMAR) runs the same code in either mode,
# driven by what the request asked for (llama.cpp aborts when a grammar's stack runs empty);
# OTHER is everything else (tokenizing, sampling, waiting for a request).
OTHER, KERNELS, GRAMMAR = 0, 1, 2
PHASES = ("outside llama.cpp's compute kernels", "in llama.cpp's compute kernels",
          "in the grammar of the request's output format")
