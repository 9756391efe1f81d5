"""Smoke test of an installed krnl wheel (CI stage 4 and cibuildwheel's test-command): the package
imports from site-packages (not a source checkout), the CPU device works, one LoRA training step
of a tiny random Llama runs and lowers the loss, and `krnl doctor --quick` passes on the CPU. Needs
only the wheel and its dependencies."""

import sys
from pathlib import Path

import numpy as np

import krnl
from krnl.models.model import LlamaModel
from krnl.models.config import LoraConfig, ModelConfig, random_weights
from krnl.train.optim import AdamW, Schedule

here = Path(krnl.__file__).resolve()
print(f"krnl {getattr(krnl, '__version__', '?')} from {here.parent}")
if "site-packages" not in here.parts and "dist-packages" not in here.parts:
    sys.exit(f"smoke: krnl was imported from {here.parent}, not from an installed wheel")
print(f"devices: {krnl.devices()}; built but unavailable here: {krnl.unavailable_devices() or 'none'}")

dev = krnl.device("cpu")
x = dev.tensor(np.arange(6, dtype=np.float32).reshape(2, 3), "f32")
assert np.array_equal(x.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))

cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=48,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 rms_norm_eps=1e-5, rope_theta=10000.0))
m = LlamaModel(dev, cfg, random_weights(cfg, 0, std=0.2), LoraConfig(r=2, alpha=4.0), dtype="f32", seed=0)
rng = np.random.default_rng(3)
ids, targets = rng.integers(0, 61, (2, 9)), rng.integers(0, 61, (2, 9))
opt = AdamW(m.lora_params, Schedule(3e-2, kind="constant"))
losses = []
for _ in range(4):
    m.lora_params.zero_grads()
    m.forward_backward(ids, targets)
    dev.synchronize()
    losses.append(m.read_loss())
    opt.step()
    dev.synchronize()
print("tiny LoRA training on cpu, loss per step: " + " ".join(f"{v:.4f}" for v in losses))
if not (np.isfinite(losses).all() and losses[-1] < losses[0]):
    sys.exit(f"smoke: the loss did not fall: {losses}")
# krnl doctor as a user runs it, from the wheel alone (its op checks ship in the package, not in tests/)
import json
import subprocess
import tempfile

with tempfile.TemporaryDirectory() as tmp:
    r = subprocess.run([sys.executable, "-m", "krnl", "doctor", "--device", "cpu", "--quick", "--report",
                        str(Path(tmp) / "doctor")], capture_output=True, text=True)
    print(next((line for line in r.stdout.splitlines() if line.startswith("krnl doctor on")), "(no summary)"))
    report = json.loads((Path(tmp) / "doctor.json").read_text()) if (Path(tmp) / "doctor.json").exists() else {}
    if r.returncode or not report.get("ok"):
        sys.exit(f"smoke: krnl doctor failed (exit {r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
print("smoke: ok")
