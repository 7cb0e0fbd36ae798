"""The compiler stack imported on a side thread while the model loads, off start-up's critical path (issue 29).

The runner's fused path needs TorchDynamo, TorchInductor and Triton as soon as it is set up ("allocated the
slots and fused the weights"), and importing them is seconds of Python (6 s for torch._dynamo alone on a 2-core
CPU). The model load before it is file reads and host-to-device copies, which release the GIL, so the imports
fit beside it. A module that fails to import here is left to fail again where the runner imports it, which
reports it as it does without this.
"""

from __future__ import annotations

import importlib
import logging
import threading

log = logging.getLogger(__name__)

COMPILER_MODULES = ("torch._dynamo", "torch._inductor.compile_fx", "tts_backend.engine.kernels")


def import_compiler_in_background() -> threading.Thread:
    def run() -> None:
        for name in COMPILER_MODULES:
            try:
                importlib.import_module(name)
            except Exception as err:  # noqa: BLE001 - the runner's own import reports it
                log.debug("background import of %s failed: %s", name, err)

    thread = threading.Thread(target=run, name="compiler-import", daemon=True)
    thread.start()
    return thread
