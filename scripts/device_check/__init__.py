"""One-shot accelerator check: everything a GPU run must confirm, in one command.

``scripts/device_check.sh OUT_DIR`` (or ``python scripts/device_check OUT_DIR``) runs, on CUDA:

1. ``kernels``: every Triton kernel compiled for CUDA against its torch twin on random inputs;
2. ``families``: our forward against Hugging Face's for Llama, Qwen2, Qwen3 and Mistral (tiny
   random configs), float32 and bfloat16;
3. ``service``: greedy output of the real service (``zerobubble serve``, gRPC on loopback) on a
   tiny random Llama against Hugging Face ``generate`` on the same device;
4. ``sync_free``: steady-state steps (n-gram and EAGLE-head decodes, prefill chunks) under
   ``torch.cuda.set_sync_debug_mode("error")``, so any host synchronisation raises;
5. ``throughput``: async ÷ sync and n-gram ÷ none at 2 / 8 / 16 prompts on a Qwen3-1.7B-shaped
   random-weight model in bfloat16 (and an EAGLE-1 head of that shape, random weights: its
   drafts are rarely accepted, so its rows show the head's cost, not its gain), CUDA graphs on
   and off, with the GPU busy fraction measured from CUDA events (the share of the run's GPU timeline covered by steps);
6. ``served``: the same model behind the real services (a ``zerobubble worker`` process on the
   device, sync and async ``zerobubble scheduler`` processes alternating in front of it, gRPC
   clients) at 16 / 64 / 256 requests, n-gram on and off, CUDA graphs on and off.

Nothing is downloaded: models are random weights of the named shapes, and tokenizers are
generated word-level vocabularies. It writes ``device_check.json`` and ``device_check.md`` to
OUT_DIR. ``--dry-run`` runs the same code on the CPU at tiny shapes (Triton under its
interpreter); parts that need CUDA are reported as skipped. A default-suite test runs it.

It is meant to run once, unattended, on a machine lent for minutes, so whatever happens it
leaves a report: each section runs in a process of its own (a CUDA error that poisons the
context, or a hang, costs that section only), the report is rewritten after every section, the
whole run keeps to ``--time-budget`` seconds (a section still running then is stopped and
reported, later ones are reported as skipped), and SIGTERM writes what was found before exiting.

Each section is a module of this package (``kernels``, ``families``, ``service``, ``sync_free``,
``throughput``, ``served``, ``environment``, ``roofline``); ``models`` holds the random models
and the step driver they share, ``run`` the process isolation and the command line. Fixtures
the tests have already (the EAGLE-1 serving head over a target) come from ``tests/support/``:
it runs from the repository root.
"""

from __future__ import annotations

import os

import torch

# Triton decides between compiling and interpreting when a kernel is defined, so the interpreter
# must be chosen before `kernels` is imported (only the CPU dry run uses it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
