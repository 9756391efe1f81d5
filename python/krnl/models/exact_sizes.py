"""A model's build with its device's buffers at their own sizes (Device.set_exact_sizes): what it
uploads (frozen weights, LoRA parameters) lives for the whole run, so the pool's size classes,
made for reuse, would only round it up: by up to 25% a buffer, 0.49 GiB of the 8b bench shape's
3.76 GiB where the LoRA fold widens each MLP weight just past 112 MiB, 0.24 GiB of a Qwen2.5-7B
embedding table. krnl.train.memory's plan mirrors the rule (Trace.exact)."""

import functools


def exact_sizes(build):
    """Decorates a model's __init__(self, device, ...): run with device.set_exact_sizes(True)."""
    @functools.wraps(build)
    def wrapped(self, device, *args, **kwargs):
        previous = device.set_exact_sizes(True)
        try:
            build(self, device, *args, **kwargs)
        finally:
            device.set_exact_sizes(previous)
        # The build's temporaries (FlatParams.load's upload) serve no other request: waited for
        # here, they go back at the next allocation instead of through the first step.
        device.synchronize()
    return wrapped
