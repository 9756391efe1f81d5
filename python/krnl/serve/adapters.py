"""The adapters one server holds, by name: each one's LoRA weights in the compute dtype kept on the
device, copied into the model's own (one device copy) when its requests run; "" (the base model)
is the model with every LoRA B zeroed (and DoRA's scale off). They share the model's LoRA layout (rank, targets, layers);
an adapter whose alpha differs has the ratio of the scales folded into its B."""

from pathlib import Path

import numpy as np

from .. import _core
from ..formats.adapter import read_adapter
from ..models.sequence_loss import adapter_off

ops = _core.ops


class Adapters:
    def __init__(self, model, paths):
        """paths {name: adapter folder}; the model already holds the first one's layout."""
        self.model, self.weights, self.current = model, {}, None
        p = model.lora_params
        self.flat = p.working if p.working is not None else p.params
        mine = model.lora_config
        if mine.full:
            raise ValueError(f"[serve] {next(iter(paths.values()), 'the adapter')} is a full fine-tune: serve the "
                             "model it wrote (--model RUN/model) instead of an adapter on its base")
        for name, path in paths.items():
            lora, tensors, _ = read_adapter(path, model.config)
            why = [f"{k} {getattr(lora, k)!r} (the first adapter's: {getattr(mine, k)!r})"
                   for k in ("r", "target_modules", "layers", "use_rslora", "use_dora")
                   if getattr(lora, k) != getattr(mine, k)]
            if why:
                raise ValueError(f"[serve] adapter {name}={path} differs in {', '.join(why)}; the adapters of one server "
                                 "share rank, targets and layers")
            ratio = lora.scale / mine.scale
            p.load({k: (v * ratio).astype(np.float32) if ".lora_B." in k and ratio != 1 else v for k, v in tensors.items()})
            self.weights[name] = self._snapshot()
        with adapter_off(model):
            self.weights[""] = self._snapshot()
        self.use(next(iter(paths), ""))

    def _snapshot(self):
        d = self.model.dev
        keep = d.empty(tuple(self.flat.shape), self.flat.dtype)
        with d.step():
            ops.cast(self.flat, keep)
        return keep

    def use(self, name):
        """The model computes with adapter `name` ("" or None: none) from now on."""
        name, sw = name or "", self.model.dora
        if name != self.current:
            with self.model.dev.step():
                ops.cast(self.weights[name], self.flat)
            self.current = name
            if sw is not None:  # DoRA's scales held while one adapter serves (nothing trains here)
                sw.release()
        if sw is not None:  # the base: B = 0 and no magnitude's scale
            sw.on, sw.hold = bool(name), True


def parse_adapters(items):
    """{name: folder} of --adapters name=path ... (a bare path is named after its folder)."""
    out = {}
    for item in items or ():
        name, eq, path = item.partition("=")
        if not eq:
            name, path = Path(item).name, item
        if not name or not path:
            raise ValueError(f"[serve] --adapters {item!r}: expected name=path")
        if name in out:
            raise ValueError(f"[serve] --adapters: the name {name!r} is given twice")
        if not Path(path).is_dir():
            raise ValueError(f"[serve] --adapters {item!r}: no adapter folder at {path}")
        out[name] = path
    return out
