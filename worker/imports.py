"""How a process of msinfer's own (a worker, the `msinfer` command) imports transformers: told
that torch is absent, and only when it needs transformers (a tokenizer, a grammar); and how a
worker imports MindSpore."""

from __future__ import annotations

import gc
import os
import sys

_OWN_PROCESS = False        # this process is msinfer's own: see own_process


def own_process() -> None:
    """Marks this process as msinfer's own (a worker, the `msinfer` command): when it first imports
    transformers (a tokenizer's, a grammar's: `before_transformers`), transformers is told that
    torch is absent (`transformers_without_torch`). Applied then, not now: a rank that loads no
    tokenizer (all but an engine's, without structured outputs) never imports transformers, whose
    utilities alone take 0.6-0.8 CPU-seconds to import; nor does a command that stops at a user
    error before it loads one."""
    global _OWN_PROCESS
    _OWN_PROCESS = True


def before_transformers() -> None:
    """Called before code of msinfer's imports transformers: see own_process."""
    if _OWN_PROCESS:
        transformers_without_torch()


def transformers_without_torch() -> bool:
    """For a process of msinfer's own (a worker, the `msinfer` command), before anything imports
    transformers: its check for torch answers no, so that loading a tokenizer (an engine's, the
    grammar's) does not import torch where it is installed. transformers imports it with its
    configuration module, and a tokenizer uses none of it: the demo model's tokenizer loads in
    1.8-3.0 s instead of 5.3 s, and the process holds no torch. Nothing is changed in a process
    that imported transformers or torch already (the tests; a program using the Python API is not
    ours: this is not called there). Returns whether it was applied."""
    # a snapshot of the names (made in one C call): another thread may be importing meanwhile, as
    # rank 0's load does while its engine starts and loads the tokenizer
    if any(m.split(".", 1)[0] in ("torch", "transformers") for m in tuple(sys.modules)):
        return False
    try:
        import transformers.utils as utils
        from transformers.utils import import_utils
    except ImportError:
        return False
    if not hasattr(import_utils, "is_torch_available"):
        return False

    def no_torch() -> bool:
        return False
    import_utils.is_torch_available = utils.is_torch_available = no_torch
    return True


# PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION: MindSpore's import sets it to "python" where it is unset
# (for its own checkpoint files, which msinfer does not read), and every process started after that
# inherits it: Ray's agents and workers, the commands a program runs, each then importing protobuf's
# pure-Python implementation (a third of a CPU-second more to import Ray alone, and slower at every
# message). A worker imported protobuf with Ray already, so MindSpore runs on protobuf's default
# (upb) there.
PROTOBUF_ENV = "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"


def import_mindspore():
    """Imports MindSpore, the first time in this process, with Python's cyclic garbage collector
    paused, then moves what the import made to the collector's permanent generation (gc.freeze):
    modules, classes and functions that live as long as the process, which every later full
    collection (frequent while graphs compile) would otherwise walk again. Importing MindSpore
    alone took 1.15-1.50 CPU-seconds so against 1.53-2.11 (six rounds each, jemalloc preloaded);
    a worker imports it once, as it joins its group. Where PROTOBUF_ENV is unset, protobuf's
    implementation is chosen before MindSpore's import and MindSpore's variable is taken out of
    the environment after it (in a process where MindSpore comes first: the tests', a program
    using the Python API); a variable the user set stays as it was."""
    if "mindspore" in sys.modules:
        return sys.modules["mindspore"]
    protobuf_unset = PROTOBUF_ENV not in os.environ
    if protobuf_unset:
        from google.protobuf.internal import api_implementation  # noqa: F401  (it reads the variable as it imports)
    enabled = gc.isenabled()
    gc.disable()
    try:
        import mindspore
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
        if protobuf_unset:
            os.environ.pop(PROTOBUF_ENV, None)
    return mindspore
